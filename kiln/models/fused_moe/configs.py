"""Launch configurations of the fused MoE kernels: a table tuned on the H200, its nearest shape, else a rule.

The table (configs/h200.json, written by benchmarks/tune_fused_moe.py) maps a layer shape, "E=..,N=..,K=..,
top_k=..,dtype=..", with N the per-rank expert intermediate size and K the hidden size, to configs per token count
bucket; the smallest bucket >= the step's token count serves it (the largest where none is). A shape the table does
not hold takes the nearest one it does of the same hidden size, top-k and dtype (the nearest N, then the nearest E):
expert parallelism's 64 experts a rank at Qwen3-30B-A3B's layer took the rule instead, whose pair kernels the sweep
had timed at 68.7 us a layer against 29.6 for the table's grouped config at one token, and decoded at 5.23 ms a step
against 2.71 with each expert split (2x H200, 2026-12-04; the step itself not yet profiled). Only a shape with no
such neighbour takes the rule. A config with block_m == 1 selects the pair kernels (no sorting; decode). Chosen per
call from the real token count, never autotuned at run time: the op runs inside CUDA graphs and compiled pieces,
where a first-call benchmark would be captured or would cost start-up time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

# KILN_FUSED_MOE_CONFIGS=path: another table (the tuning script's fresh output, for an A/B in the same run)
TABLE = Path(os.environ.get("KILN_FUSED_MOE_CONFIGS") or Path(__file__).parent / "configs" / "h200.json")


@dataclass(frozen=True)
class MoeKernelConfig:
    block_m: int = 16  # pairs per program; 1: the pair (matrix-vector) kernels
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def shape_key(num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},N={inter},K={hidden},top_k={top_k},dtype={str(dtype).removeprefix('torch.')}"


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[int, MoeKernelConfig]]:
    if not TABLE.is_file():
        return {}
    raw = json.loads(TABLE.read_text())
    return {key: {int(bucket): MoeKernelConfig(**cfg) for bucket, cfg in buckets.items()}
            for key, buckets in raw.get("configs", {}).items()}


def _fields(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(","))


@lru_cache(maxsize=64)
def _nearest(num_experts: int, inter: int, hidden: int, top_k: int,
             dtype: torch.dtype) -> dict[int, MoeKernelConfig] | None:
    """The buckets of the tuned shape closest to this one with the same K, top_k and dtype (N, then E, by ratio)."""
    want = _fields(shape_key(num_experts, inter, hidden, top_k, dtype))
    candidates = [(key, _fields(key)) for key in _table()]
    same = [(key, f) for key, f in candidates if all(f[k] == want[k] for k in ("K", "top_k", "dtype"))]
    if not same:
        return None

    def distance(fields: dict[str, str]) -> tuple[float, float]:
        return (abs(math.log(int(fields["N"]) / inter)), abs(math.log(int(fields["E"]) / num_experts)))

    return _table()[min(same, key=lambda kf: distance(kf[1]))[0]]


def heuristic(num_experts: int, top_k: int, num_tokens: int) -> MoeKernelConfig:
    """By pairs per expert: the pair kernels while a token's experts are rarely shared, then taller tiles."""
    pairs = num_tokens * top_k
    if pairs <= min(64, max(num_experts // 2, top_k)):  # few enough that experts are rarely read twice
        return MoeKernelConfig(block_m=1, block_n=32, block_k=128, num_warps=4, num_stages=3)
    per_expert = pairs / num_experts
    if per_expert <= 16:
        return MoeKernelConfig(16, 64, 64, 4, 3)
    if per_expert <= 64:
        return MoeKernelConfig(32, 64, 64, 4, 3)
    return MoeKernelConfig(64, 128, 64, 8, 3)


def pick_config(num_experts: int, inter: int, hidden: int, top_k: int, num_tokens: int,
                dtype: torch.dtype) -> MoeKernelConfig:
    buckets = _table().get(shape_key(num_experts, inter, hidden, top_k, dtype)) or _nearest(
        num_experts, inter, hidden, top_k, dtype)
    if not buckets:
        return heuristic(num_experts, top_k, num_tokens)
    fitting = [b for b in buckets if b >= num_tokens]
    return buckets[min(fitting) if fitting else max(buckets)]
