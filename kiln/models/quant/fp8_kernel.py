"""A Triton FP8 GEMM for decode-sized M: out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n].

Why it exists (issue 17): at decode, M (tokens) is 1..64 and the GEMM only has to stream the e4m3 weight
once, so its floor is weight bytes / copy bandwidth. cuBLAS's row-wise `_scaled_mm` picks one
128x128-tile kernel for every small M on the H200 and ran no faster than bf16 (3.75 ms vs 4.03 ms per
Llama-3-8B step at M=1, floor ~1.7 ms): too few tiles to keep 132 SMs streaming. This kernel reads the
same quantized operands (the activation quantized by the same torch code, so results do not depend on
which path ran) and fills the GPU with small N tiles and, where N alone is too few tiles, split-K.

Shape of the kernel ("swap AB"): each program computes a [BLOCK_N, BLOCK_M] tile as tl.dot(W tile,
X tile^T), so the weight rows take the MMA's large M side (64 on Hopper's wgmma) and the few tokens its
small N side (padded to 16 with masks). Both operands are K-contiguous, the layout fp8 MMAs want.
Split-K writes fp32 partials [SPLIT_K, M, N] and a second tiny kernel sums them in a fixed order, applies
the scales and casts: deterministic, unlike atomics, at the cost of SPLIT_K * M * N * 8 bytes of traffic
(small next to the weight at decode M, and mostly L2-resident; the sweep shows where split-K pays).
Folding that sum into the GEMM kernel (the last split of a tile to finish sums the partials, counted by an
atomic) was measured and removed: no faster at decode on the H200 (FP8 8B, bf16 SmolLM2-135M; docs/models.md).

Tile configs are chosen per shape by `pick_config` (a rule plus the `TUNED` table filled from an H200 sweep,
benchmarks/bench_gemm.py --part small-m), never autotuned at run time: the op runs inside CUDA graphs and
compiled pieces, where a first-call benchmark would be captured or would cost start-up time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from kiln.models import gemv, gemv_stream
from kiln.models.pdl import pdl_launch, pdl_start


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One tile configuration. block_n / block_k: the weight tile each program streams per step; split_k:
    programs along K per output tile; num_warps / num_stages: Triton's launch and pipelining depth; promote (e4m3
    operands only): products Hopper's fp8 MMA sums in its reduced-precision accumulator before each fp32 add, at
    most one K step's (block_k; more means that), 0 Triton's default (the whole K loop, up to 3 bf16 ulps off)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    promote: int = 128

    def __post_init__(self) -> None:
        if self.promote < 0:
            raise ValueError(f"promote={self.promote}: must be >= 0")


# (N, K, largest M) -> config, measured on an H200 (benchmarks/bench_gemm.py --part small-m). The first
# entry whose N, K match and whose largest M is >= M wins (entries of a shape in ascending M); shapes not listed
# fall back to the rule below. Llama-3-8B's projections (o 4096 x 4096, down 4096 x 14336, qkv 6144 x 4096, gate_up
# 28672 x 4096): M = 16 / 32 / 64 swept with the fp32 promotion every 32, 64 and 128 products (one H200, 2026-12-06,
# `GEMM_M="16 32 64" GEMM_ARGS="--promote 32 64 128 --no-bf16-sweep" run.sh gemm`, benchmarks/results/
# 2026-12-06-h200-88b16de), us at M = 64, the best tile at 32 -> at 128: qkv 12.61 -> 10.17, o 8.87 -> 7.95, gate_up
# 34.51 -> 33.51, down 20.62 -> 19.98 (at M = 16 within 0.3 us; the same tile's median ratio 1.00 at M = 16, 1.03-1.05
# at 64). FP8 8B decode with these tiles 2.892 / 2.883 and 4.013 / 4.006 ms at batch 8 / 64 against 2.910 / 2.903 and
# 4.102 / 4.109 (two processes per arm, the same machine). The M = 1 entry of qkv and the M = 4 / 8 ones of down
# and qkv (swept 2026-12-03 at 32) went: M <= 16 runs the same BLOCK_M = 16 program as M = 16.
TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {
    (4096, 4096, 32): Fp8GemmConfig(64, 128, 4, 4, 6),
    (4096, 4096, 64): Fp8GemmConfig(64, 128, 2, 4, 6),
    (4096, 14336, 32): Fp8GemmConfig(64, 128, 4, 4, 6),
    (4096, 14336, 64): Fp8GemmConfig(64, 128, 2, 4, 6),
    (6144, 4096, 16): Fp8GemmConfig(64, 128, 4, 4, 6),
    (6144, 4096, 64): Fp8GemmConfig(64, 128, 1, 4, 6),
    (28672, 4096, 16): Fp8GemmConfig(64, 256, 1, 4, 4, 64),
    (28672, 4096, 32): Fp8GemmConfig(64, 256, 1, 4, 4),
    (28672, 4096, 64): Fp8GemmConfig(64, 128, 1, 4, 6),
}

# The 16-bit path's (N, K, largest M) table, the same lookup. One config for every M <= 16 of a shape: M = 1
# (decode) and M <= 16 (a speculative verify) must sum in the same order for greedy tokens to stay the same.
# Qwen3-30B-A3B's attention projections, where the rule's split (qkv 2, o 8) took 9.07 / 8.94 us at M = 1 against
# 8.28 / 7.93 (H200, 2026-12-02, `bench_gemm --preset qwen3-30b-a3b --projections qkv o --m 1 8`, the same
# winners at M = 8; benchmarks/results/2026-12-02-h200-34c24bb). SmolLM2-135M's four projections, the same winners
# at M = 1 and 8 (H200, 2026-12-03, `bench_gemm --preset smollm2-135m --m 1 8`; rule -> best at M = 1: qkv 3.40 ->
# 3.32 us, o 3.37 -> 3.30, gate_up 3.72 -> 3.62, down 5.04 -> 4.58; benchmarks/results/2026-12-03-h200-7b26b05).
TUNED_16BIT: dict[tuple[int, int, int], Fp8GemmConfig] = {
    (5120, 2048, 16): Fp8GemmConfig(64, 128, 1, 4, 4),
    (2048, 4096, 16): Fp8GemmConfig(64, 128, 4, 4, 4),
    (960, 576, 16): Fp8GemmConfig(64, 64, 1, 4, 6),
    (576, 576, 16): Fp8GemmConfig(64, 64, 1, 4, 6),
    (3072, 576, 16): Fp8GemmConfig(64, 64, 1, 4, 6),
    (576, 1536, 16): Fp8GemmConfig(64, 128, 4, 4, 4),
}

# Programs per SM the rule aims for: two resident programs each keep several weight tiles in flight.
_PROGRAMS_PER_SM = 2
# Split-K is not taken below this many BLOCK_K steps per split: the pipeline needs a few to fill.
_MIN_K_STEPS_PER_SPLIT = 4


def block_m_for(m: int) -> int:
    """Tokens per tile: the MMA's small side, at least 16 (the smallest tl.dot), at most 64."""
    return min(64, max(16, triton.next_power_of_2(m)))


@lru_cache(maxsize=1)
def swept_tables() -> dict[str, dict[tuple[int, int, int], Fp8GemmConfig]]:
    """KILN_GEMM_CONFIGS=path: the tables `bench_gemm --table-out` wrote ({"fp8": [...], "16bit": [...]}, entries
    {"N", "K", "max_m", "config"}), looked up before TUNED / TUNED_16BIT: a fresh sweep's tiles in an A/B of the
    same run, or the tiles of a GPU the shipped tables were not measured on."""
    path = os.environ.get("KILN_GEMM_CONFIGS")
    if not path:
        return {"fp8": {}, "16bit": {}}
    raw = json.loads(Path(path).read_text())
    return {kind: {(e["N"], e["K"], e["max_m"]): Fp8GemmConfig(**e["config"])
                   for e in sorted(raw.get(kind, []), key=lambda e: (e["N"], e["K"], e["max_m"]))}
            for kind in ("fp8", "16bit")}


def pick_config(m: int, n: int, k: int, num_sms: int, element_bytes: int = 1) -> Fp8GemmConfig:
    """The tile config for an [M, K] x [N, K]^T GEMM on a GPU with num_sms SMs (TUNED holds FP8 shapes,
    TUNED_16BIT 16-bit ones, a KILN_GEMM_CONFIGS table either before them; the rule gives 16-bit operands half
    the K tile, the same bytes per step)."""
    swept = swept_tables()["fp8" if element_bytes == 1 else "16bit"]
    for (tn, tk, max_m), config in [*swept.items(), *(TUNED if element_bytes == 1 else TUNED_16BIT).items()]:
        if tn == n and tk == k and m <= max_m:
            return config
    block_n, block_k = 64, 256 // element_bytes
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m_for(m))
    split = 1
    while (tiles * split * 2 <= num_sms * _PROGRAMS_PER_SM
           and k // (split * 2) >= _MIN_K_STEPS_PER_SPLIT * block_k):
        split *= 2
    return Fp8GemmConfig(block_n=block_n, block_k=block_k, split_k=split)


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; an H200's 132 elsewhere (the CPU interpreter, where only correctness counts)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def accumulate(x_ptr, w_ptr, offs_n, n_mask, offs_m, m_mask, K, k_lo, k_steps, s_xm, s_wn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               EVEN_N: tl.constexpr, SCALED: tl.constexpr, PROMOTE: tl.constexpr):
    """acc[BLOCK_N, BLOCK_M] = sum over [k_lo, k_lo + k_steps * BLOCK_K) of W[offs_n, k] * X[offs_m, k]: the
    weight rows a program streams (any rows: the epilogue kernels pair them) against its tokens, past K masked."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * s_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_steps):
        if EVEN_K:
            x_mask = m_mask[:, None]
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k_lo + step * BLOCK_K + offs_k) < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if SCALED and PROMOTE > 0:  # e4m3: Hopper's fp8 MMA accumulates in reduced precision; fp32 adds between
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


# M is not specialized (Triton would compile M == 1 and M % 16 == 0 apart): fewer compiles at start-up,
# where every CUDA-graph size runs once, for no loss (M only masks the few activation rows)
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, k_steps, s_xm, s_wn, s_om, s_op,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SCALED: tl.constexpr, PROMOTE: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (n tile, k split, m tile): acc[BLOCK_N, BLOCK_M] over its K range. Without split-K the scales
    are applied and out [M, N] is written in its dtype; with it, fp32 partials go to out[split, M, N]. The scales
    are loaded before the K loop (the weight's before the PDL wait: no kernel of a step writes it): after the loop
    they cost a DRAM round trip of their own at the end of every program."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if SCALED and not SPLIT:
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    pdl_start(PDL)
    if SCALED and not SPLIT:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    # this split's K range is [k_lo, k_lo + k_steps * BLOCK_K); past K (the last split) the loads are masked
    acc = accumulate(x_ptr, w_ptr, offs_n, n_mask, offs_m, m_mask, K, pid_k * k_steps * BLOCK_K, k_steps, s_xm,
                     s_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, SCALED, PROMOTE)
    out_mask = n_mask[:, None] & m_mask[None, :]
    out_offs = offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * s_op + out_offs, acc, mask=out_mask)
    elif SCALED:
        y = acc * xs[None, :] * ws[:, None]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # bf16 operands: no scales
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(p_ptr, xs_ptr, ws_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                           SCALED: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = (sum over splits, in order, of partial[s, m, n]) * x_scale[m] * w_scale[n]."""
    pdl_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * M * N + offs, mask=mask, other=0.0)
    if SCALED:
        xs = tl.load(xs_ptr + offs // N, mask=mask, other=0.0)
        ws = tl.load(ws_ptr + offs % N, mask=mask, other=0.0)
        acc = acc * xs * ws
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemm_triton(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """q [M, K] e4m3, weight [N, K] e4m3, x_scale [M, 1] (or [M]) fp32, weight_scale [N] fp32 -> [M, N]."""
    return _small_m_gemm(q, weight, *flat_scales(x_scale, weight_scale), out_dtype, config)


def flat_scales(x_scale: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token and per-channel scales as the kernels read them: flat, contiguous fp32."""
    return x_scale.reshape(-1).float().contiguous(), weight_scale.reshape(-1).float().contiguous()


def bf16_gemm_triton(x: torch.Tensor, weight: torch.Tensor, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """The same kernel on 16-bit operands without scales: x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype.
    Measured against cuBLAS by benchmarks/bench_gemm.py --part small-m (bf16 rows, TP-sharded shapes too)."""
    return _small_m_gemm(x, weight, None, None, x.dtype, config)


def check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """An [M, K] activation and an [N, K] weight, both K-contiguous (what the small-M kernels' loads assume)."""
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match K={x.shape[1]} of the activation")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x/weight: the K dimension must be contiguous")


def split_k(k: int, config: Fp8GemmConfig, splits: int) -> tuple[int, int, bool]:
    """-> (splits, BLOCK_K steps a split, whether K is a whole number of split ranges): every split covers a whole
    number of BLOCK_K steps; only the last may run past K (masked loads)."""
    splits = max(1, min(splits, triton.cdiv(k, config.block_k)))
    k_steps = triton.cdiv(triton.cdiv(k, splits), config.block_k)
    return triton.cdiv(k, k_steps * config.block_k), k_steps, k % (k_steps * config.block_k) == 0


def launch_gemm(q: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                target: torch.Tensor, config: Fp8GemmConfig, steps: tuple[int, int, bool],
                pdl: dict[str, bool]) -> None:
    """One launch of the small-M kernel into `target`: out [M, N] in its dtype (scales applied), or fp32 partials
    [splits, M, N] for a kernel after it to sum. `scales`: flat_scales' pair, None for 16-bit operands; `steps`:
    split_k's for the config."""
    m, k = q.shape
    n = weight.shape[0]
    split, k_steps, even_k = steps
    block_m = block_m_for(m)
    xs, ws = scales if scales is not None else (target, target)  # unread without scales
    _fp8_gemm_kernel[(triton.cdiv(n, config.block_n), split, triton.cdiv(m, block_m))](
        q, weight, xs, ws, target, m, n, k, k_steps, q.stride(0), weight.stride(0), n, m * n, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=target.dim() == 3, EVEN_K=even_k,
        EVEN_N=n % config.block_n == 0, SCALED=scales is not None, PROMOTE=min(config.promote, config.block_k),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl)


def gemm_partials(x: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """The small-M GEMM's fp32 sums for a kernel after it to finish: [splits, M, N] (one whole-K partial when the
    shape's config does not split K), unscaled; the config is the one `_small_m_gemm` would pick, so the sums are
    the ones its output rounds. `scales`: flat_scales' pair for FP8 operands, None for 16-bit ones."""
    (m, k), n = x.shape, weight.shape[0]
    if config is None and scales is None and gemv.applies(m, n, k, x.element_size()):
        return gemv.gemv(x, weight, gemv.PARTIALS)
    if config is None and gemv_stream.applies(m, x.element_size(), x.device):
        return gemv_stream.gemv_stream(x, weight, mode=gemv.PARTIALS)
    config = config or pick_config(m, n, k, num_sms(x.device), x.element_size())
    steps = split_k(k, config, config.split_k)
    partials = torch.empty((steps[0], m, n), dtype=torch.float32, device=x.device)
    if m > 0:
        launch_gemm(x, weight, scales, partials, config, steps, pdl_launch(x.device))
    return partials


def _small_m_gemm(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None,
                  weight_scale: torch.Tensor | None, out_dtype: torch.dtype,
                  config: Fp8GemmConfig | None) -> torch.Tensor:
    check_operands(q, weight)
    m, k = q.shape
    n = weight.shape[0]
    if config is None and x_scale is None and gemv.applies(m, n, k, q.element_size()):
        return gemv.gemv(q, weight)
    if config is None and gemv_stream.applies(m, q.element_size(), q.device):  # e4m3 operands: both scales given
        return gemv_stream.gemv_stream(q, weight, (x_scale, weight_scale), out_dtype)
    config = config or pick_config(m, n, k, num_sms(q.device), q.element_size())
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return out
    steps = split_k(k, config, config.split_k)
    split = steps[0]
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=q.device)
    scales = (x_scale, weight_scale) if x_scale is not None and weight_scale is not None else None
    pdl = pdl_launch(q.device)
    launch_gemm(q, weight, scales, target, config, steps, pdl)
    if split > 1:
        block = 1024
        xs, ws = scales if scales is not None else (out, out)  # unread without scales
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](target, xs, ws, out, m, n,
                                                             SPLIT_K=split, BLOCK=block, SCALED=scales is not None,
                                                             num_warps=4, **pdl)
    return out
