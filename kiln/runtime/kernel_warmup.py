"""Triton compiles of kiln's own kernels on a thread, during the compile phase of a start.

Graph capture runs every capture size once, and the first run of each of kiln's Triton kernels at a new
specialization compiles it (the small-M GEMM of `kiln::dense_gemm` per projection shape and M, the decode
attention per split count, the varlen attention): on a cold 8B start on the H200 they made the capture phase
15.6 s instead of ~3 s. Those kernels need no compiled model, so a thread
started with the compile phase runs each once on inputs of its own (the model's weights read, nothing of the
runner's touched), while Inductor's compiles run in worker processes. The capture phase joins it first, so no
launch from it overlaps a capture. On a warm start each run finds its kernel in Triton's cache. Any failure is
logged and left to the capture to meet again. Measured: cold start 49.6 -> 44.9 s to the first token, capture
15.6 -> 3.7 s, the compile phase 3.8 s longer (docs/startup.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from kiln.attention.base import AttentionBackend, CommonAttentionMetadata
from kiln.models import dense_gemm
from kiln.models.layers import _ParallelLinear

logger = logging.getLogger("kiln")


def gemm_shapes(model: torch.nn.Module) -> list[torch.Tensor]:
    """One weight per distinct (N, K, dtype) among the projections that go through `kiln::dense_gemm`."""
    seen: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, _ParallelLinear) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            seen.setdefault((*weight.shape, weight.dtype), weight)
    return list(seen.values())


def run_gemms(weights: Iterable[torch.Tensor], sizes: Iterable[int]) -> int:
    """Each weight at each M the small-M kernel serves; -> launches."""
    from kiln.models.quant.fp8_kernel import bf16_gemm_triton  # triton: imported where a GPU start needs it

    launches = 0
    for weight in weights:
        x_like = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        if not dense_gemm.applies(x_like, None):
            continue
        for m in sizes:
            if 0 < m <= dense_gemm.TRITON_MAX_M:
                bf16_gemm_triton(x_like.new_zeros(m, weight.shape[1]), weight)
                launches += 1
    return launches


def run_attention(backend: Any, decode_sizes: Iterable[int], block_table_width: int) -> int:
    """A throwaway backend of the runner's backend's class and layout (workspaces of its own), on a cache of
    its own: a uniform decode batch per distinct split count of `decode_sizes`, and one prefill chunk; block
    tables as wide as the runner's (their stride is a kernel argument Triton specializes on). -> launches."""
    layout, device = backend.layout, backend.device
    fresh = type(backend)(layout, device)
    cache = torch.zeros(2, 2, layout.block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.cache_dtype,
                        device=device)
    by_splits: dict[int, int] = {}
    for n in sorted(set(decode_sizes)):
        by_splits.setdefault(fresh.num_splits(n), n)
    launches = 0
    for num_reqs, num_tokens in [(n, n) for n in by_splits.values()] + [(1, 32)]:
        lens = [num_tokens // num_reqs] * num_reqs
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
            block_tables=torch.zeros(num_reqs, block_table_width, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, max_query_len=max(lens), max_seq_len=max(lens),
            uniform_decode=num_reqs == num_tokens)
        q = torch.zeros(num_tokens, layout.num_heads, layout.head_dim, dtype=layout.dtype, device=device)
        k = torch.zeros(num_tokens, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype, device=device)
        fresh.forward(q, k, torch.zeros_like(k), torch.empty_like(q), cache, fresh.build_metadata(common))
        launches += 1
    return launches


class KernelWarmup:
    """The thread; `join()` waits for it (and says how long it ran)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sizes: Iterable[int],
                 decode_sizes: Iterable[int], block_table_width: int) -> None:
        self.launches = 0
        self.seconds = 0.0
        weights, sizes, decode_sizes = gemm_shapes(model), sorted(set(sizes)), sorted(set(decode_sizes))
        device = backend.device

        def work() -> None:
            start = time.perf_counter()
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # the current device is per thread
                with torch.inference_mode():
                    self.launches += run_gemms(weights, sizes)
                    if backend.name == "triton":
                        self.launches += run_attention(backend, decode_sizes, block_table_width)
            except Exception as exc:  # noqa: BLE001 - an optimisation: the capture compiles what is left
                logger.warning("kernel warm-up thread stopped early (%s: %s)", type(exc).__name__, exc)
            self.seconds = time.perf_counter() - start

        self._thread = threading.Thread(target=work, name="kiln-kernel-warmup", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        logger.info("kernel warm-up: %d launches in %.1f s beside the compile phase", self.launches, self.seconds)
