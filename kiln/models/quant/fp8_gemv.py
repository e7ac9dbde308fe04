"""An FP8 matrix-vector kernel for one token: each program streams a few e4m3 weight rows through a K loop and dots
them against the token's e4m3 activation on the CUDA cores, then applies both scales.

Why: at one token the FP8 MMA kernel (fp8_kernel.py) pads the token to a 16-row MMA tile and moves ~82% of the copy
bandwidth on Llama-3-8B's projections (2.03 ms a step of GEMMs against 1.66 of bytes, one H200), where the bf16
one moves ~92%. A dot on the CUDA cores needs no MMA tile: any number of rows a program, so many small programs
spread every projection over the SMs in even waves, and its only split is by rows, so no partial sums to reduce.
The products and their fp32 sums are exact up to summation order, so it gives the MMA kernel's values up to rounding.

Only M = 1 (decode at batch 1): the kernel reads the weight once per token. A runner that speculates suspends it as
it suspends the 16-bit matrix-vector kernel (kiln/models/gemv.py): its decode must equal its verify bit for bit.
On by measurement (one H100, 2026-12-06): Llama-3-8B's four FP8 projections at one token 2.635 -> 2.541 ms a step
(floor 2.313), FP8 8B decode at batch 1 3.538, 3.534 -> 3.513, 3.504 ms (two processes per arm, alternated;
docs/models.md). KILN_FP8_GEMV=0 turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.models import gemv
from kiln.models.pdl import pdl_launch, pdl_start

ENABLED = os.environ.get("KILN_FP8_GEMV", "1") == "1"
# Programs the rule aims for per SM: several resident programs keep enough weight loads in flight. 4: the sweep's best
# rows at every Llama-3-8B projection (one H100, 2026-12-06, `bench_gemm --part fp8-gemv`; 8 took half the rows at o
# and qkv, 3-4% slower there)
_PROGRAMS_PER_SM = 4
_TILE_BYTES = 4096  # e4m3 weight bytes a program loads per K step


@dataclass(frozen=True)
class Fp8GemvConfig:
    """rows: weight rows a program dots; block_k: K elements a step; num_warps / num_stages: Triton's."""

    rows: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def applies(m: int) -> bool:
    """Whether an FP8 projection of M tokens runs here."""
    return ENABLED and m == 1 and not gemv.is_suspended()


def pick_config(n: int, k: int, num_sms: int) -> Fp8GemvConfig:
    """The most rows a program (at most 16) that still leaves _PROGRAMS_PER_SM programs an SM, and a K step of
    _TILE_BYTES."""
    rows = 16
    while rows > 1 and triton.cdiv(n, rows) < _PROGRAMS_PER_SM * num_sms:
        rows //= 2
    return Fp8GemvConfig(rows, min(triton.next_power_of_2(k), max(16, _TILE_BYTES // rows)))


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, s_wn, R: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: output columns [p R, p R + R). SCALED: out in its dtype with both scales applied; else the
    unscaled fp32 sums (a kernel after it finishes them)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_mask = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    pdl_start(PDL)
    acc = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:  # N % R == 0 and K % BLOCK_K == 0
            w = tl.load(w_ptrs)
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            k_mask = k0 + offs_k < K
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    sums = tl.sum(acc, 1)
    if SCALED:
        y = sums * tl.load(xs_ptr) * tl.load(ws_ptr + rows, mask=row_mask, other=0.0)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        tl.store(out_ptr + rows, sums, mask=row_mask)


def fp8_gemv(q: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
             out_dtype: torch.dtype, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """q [1, K] e4m3 @ weight [N, K]^T e4m3 -> [1, N] in out_dtype scaled by `scales` (flat x_scale [1], w_scale
    [N] fp32), or with scales None its unscaled fp32 sums as one split's partials [1, 1, N]."""
    (m, k), n = q.shape, weight.shape[0]
    if m != 1:
        raise ValueError(f"q: one token expected, got shape {tuple(q.shape)}")
    from kiln.models.quant.fp8_kernel import num_sms

    config = config or pick_config(n, k, num_sms(q.device))
    out = torch.empty((1, n), dtype=out_dtype, device=q.device) if scales is not None else \
        torch.empty((1, 1, n), dtype=torch.float32, device=q.device)
    xs, ws = scales if scales is not None else (out, out)  # unread without scales
    even = n % config.rows == 0 and k % config.block_k == 0
    _fp8_gemv_kernel[(triton.cdiv(n, config.rows),)](
        q, xs, weight, ws, out, n, k, weight.stride(0), R=config.rows, BLOCK_K=config.block_k, EVEN=even,
        SCALED=scales is not None, num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(q.device))
    return out
