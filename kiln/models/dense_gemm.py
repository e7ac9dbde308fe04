"""`kiln::dense_gemm`: the GEMM of every 16-bit projection on CUDA, dispatched on M at run time.

Decode-sized M (M <= TRITON_MAX_M) runs the small-M Triton kernel that also serves FP8
(kiln/models/quant/fp8_kernel.py, its bf16 path: the weight rows on the MMA's wide side, split-K where N
alone leaves SMs idle); larger M runs torch.mm (cuBLAS). Measured on an H200 (docs/BENCHMARKS.md, the
GEMM sweep of 2026-11-30): over the four Llama-3-8B projections the Triton kernel took 3.57 ms a step
against cuBLAS's 3.78 at M=1, and 2.04 against 2.17 on one rank's TP=2 shards, about even at M=8-16, and
lost from M=32 on; hence 16.

Why a custom op: M is dynamic in the compiled pieces, so the choice is made per call inside an op opaque
to Dynamo (the fake gives the shape); CUDA graphs capture whichever kernel ran for their size. The op only
stands in for a plain `x @ W^T` (no bias), so Inductor lost nothing it fused before: an mm is an extern
kernel call either way at -O2. KILN_BF16_TRITON_MAX_M=0 keeps F.linear (no op in the graph at all).
"""

from __future__ import annotations

import os

import torch

TRITON_MAX_M = int(os.environ.get("KILN_BF16_TRITON_MAX_M", "16"))


def applies(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a projection goes through the op (decided while tracing: device, dtype, no bias)."""
    return TRITON_MAX_M > 0 and x.is_cuda and bias is None and x.dtype in (torch.bfloat16, torch.float16)


@torch.library.custom_op("kiln::dense_gemm", mutates_args=())
def dense_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype."""
    if x.shape[0] <= TRITON_MAX_M:
        from kiln.models.quant.fp8_kernel import bf16_gemm_triton

        return bf16_gemm_triton(x, weight)
    return torch.mm(x, weight.t())


@dense_gemm.register_fake
def _dense_gemm_fake(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))
