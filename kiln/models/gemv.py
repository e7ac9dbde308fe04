"""A matrix-vector kernel for small 16-bit projections at decode sizes: each program holds a few whole weight rows
in registers and dots every token against them on the CUDA cores.

Why: a small model's projection at one token moves ~0.7-3.5 MB, which HBM delivers in well under a microsecond,
so its kernel's time is latency: the MMA kernel (kiln/models/quant/fp8_kernel.py) streams each program's rows
through a K loop after the programmatic-dependent-launch wait, a DRAM round trip behind the kernel before it.
Here a program's whole weight slice (rows x all of K, at most 16 KB) is one load issued *before* the wait:
weights are never written during a step, so they may be read while the previous kernel still runs, and the
wait then only guards the activation. The same layout with a barrier-free chain of kernels against one
persistent kernel and against the MMA kernel is `benchmarks/bench_persistent.py` (docs/cuda_graphs.md); the
decode A/B that turned it on, docs/models.md.

Only one token pays (MAX_TOKENS): the kernel re-reads its weight slice for every token, a program per token, so
at 16 tokens SmolLM2-135M's step took twice the MMA kernel's (docs/models.md). A token's sums are the same at any M
(one row-block dot a token), but at M = 1 they are not the MMA kernel's, which a speculative verify (M = k + 1)
runs: a runner that speculates calls `suspended()` around its forwards, so its decode stays its verify bit for
bit. The epilogue kernels (gemm_epilogues.py) read the same sums as the plain projection.

Three outputs (MODE): the projection in the activation's dtype; its fp32 sums (a "partials" tensor of one
split, for the add + RMSNorm row kernel); silu(gate) * up with a program's gate rows and the up rows N below. And
one prologue (`gemv_after_norm`, the rmsnorm_gemm pass): the operand is the row a projection into the residual
stream left unfinished (its sums + the residual, RMS-normalised), which the row kernel would otherwise finish in a
kernel of its own; cheap here, where the operand is a vector each program holds whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

# Calls this kernel takes (16-bit weights): at most MAX_TOKENS tokens, K up to MAX_K (a program's rows hold all of
# K in registers) and at most MAX_BYTES of weight (where latency, not bandwidth, sets a projection's time). On by
# measurement (SmolLM2-135M at batch 1, docs/models.md); KILN_GEMV=0 turns it off.
ENABLED = os.environ.get("KILN_GEMV", "1") == "1"
MAX_TOKENS = int(os.environ.get("KILN_GEMV_MAX_TOKENS", "1"))
MAX_K = 2048
MAX_BYTES = int(os.environ.get("KILN_GEMV_MAX_BYTES", str(4 << 20)))
_suspended = contextvars.ContextVar("kiln_gemv_suspended", default=False)
TILE_ELEMENTS = 8192  # rows x K (padded) a program holds: 16 KB of bf16, 64 registers a thread at 4 warps

OUT, PARTIALS, SILU_MUL = 0, 1, 2


def takes(n: int, k: int, element_bytes: int) -> bool:
    """Whether an [N, K] weight's one-token projection may run here (N: all rows, gate and up together for
    SiLU-mul)."""
    return ENABLED and element_bytes == 2 and k <= MAX_K and n * k * element_bytes <= MAX_BYTES


def applies(m: int, n: int, k: int, element_bytes: int) -> bool:
    """Whether M tokens' projection by an [N, K] weight runs here."""
    return m <= MAX_TOKENS and not _suspended.get() and takes(n, k, element_bytes)


def is_suspended() -> bool:
    """Whether the caller runs inside `suspended()` (the streaming kernel, gemv_stream.py, keeps the same rule)."""
    return _suspended.get()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No call takes this kernel inside the block (nor any CUDA graph captured there)."""
    token = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(token)


def rows_per_program(k: int) -> int:
    """Depends on K only, so every mode and every M reduce a row in the same order (the same tile shape)."""
    return max(1, min(16, TILE_ELEMENTS // triton.next_power_of_2(k)))


@triton.jit
def _load_rows(w_ptr, rows, N, K, s_wn, KP: tl.constexpr):
    offs_k = tl.arange(0, KP)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * s_wn + offs_k[None, :],
                   mask=(rows < N)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _finished_row(p_ptr, res_ptr, g, h_ptr, n_ptr, m, K, s_p, s_res, eps, store_k, offs_k,
                  SPLITS: tl.constexpr):
    """Token m's operand when a projection into the residual stream left its row unfinished: h = round(round(sum
    of the SPLITS fp32 partials, in order) + residual) and the normalised row g * round(h / rms(h)) rounded to 16
    bits (g: the norm's weight, fp32, loaded before the PDL wait), as the add + RMSNorm row kernel
    (gemm_epilogues.py) rounds; one program (`store_k`: K there, 0 elsewhere) writes both, h to h_ptr and the
    normalised row to n_ptr (for other ops that read it)."""
    k_mask = offs_k < K
    acc = tl.load(p_ptr + m * K + offs_k, mask=k_mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * s_p + m * K + offs_k, mask=k_mask, other=0.0)
    dtype = h_ptr.dtype.element_ty
    res = tl.load(res_ptr + m * s_res + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    h = (acc.to(dtype).to(tl.float32) + res).to(dtype)
    tl.store(h_ptr + m * K + offs_k, h, mask=offs_k < store_k)
    hf = h.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(hf * hf, 0) / K + eps)
    normed = (g * (hf * inv).to(dtype).to(tl.float32)).to(dtype)
    tl.store(n_ptr + m * K + offs_k, normed, mask=offs_k < store_k)
    return normed.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, s_xm, s_wn, s_om, res_ptr, g_ptr, h_ptr, n_ptr, s_p, s_res, eps,
                 R: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr, SPLITS: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program (p, m): output columns [p R, p R + R) of token m, a dot over the whole of K. SPLITS > 0: x_ptr
    holds a projection's fp32 partials and the token's operand is `_finished_row`'s."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    offs_k = tl.arange(0, KP)
    w = _load_rows(w_ptr, rows, N, K, s_wn, KP)  # before the wait: weights are never written during a step
    if MODE == 2:
        w_up = _load_rows(w_ptr + N * s_wn, rows, N, K, s_wn, KP)
    if SPLITS > 0:  # the norm's weight too (after the row's reduction it would cost a DRAM round trip of its own)
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    pdl_start(PDL)
    mask = rows < N
    m = tl.program_id(1)
    if SPLITS > 0:
        x = _finished_row(x_ptr, res_ptr, g, h_ptr, n_ptr, m, K, s_p, s_res, eps,
                          tl.where(tl.program_id(0) == 0, K, 0), offs_k, SPLITS)
    else:
        x = tl.load(x_ptr + m * s_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    dst = out_ptr + m * s_om + rows
    if MODE == 0:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        tl.store(dst, acc, mask=mask)
    else:  # each projection rounded as the GEMM's output would be, then silu(gate) * up in fp32
        dtype = out_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        up = tl.sum(w_up.to(tl.float32) * x[None, :], 1).to(dtype).to(tl.float32)
        tl.store(dst, (gate * tl.sigmoid(gate) * up).to(dtype), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, mode: int = OUT) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T: [M, N] in x's dtype (OUT), fp32 sums [1, M, N] (PARTIALS), or with weight's
    rows gate then up, silu(gate) * up [M, N / 2] in x's dtype (SILU_MUL). Both operands K-contiguous."""
    m, k = x.shape
    n = weight.shape[0] // 2 if mode == SILU_MUL else weight.shape[0]
    if mode == PARTIALS:
        out = torch.empty((1, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _launch(x, weight, out, mode, x.stride(0), (x, x, x, x, 0, 0, 0.0), 0)
    return out


def gemv_after_norm(partials: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, mode: int = OUT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projection `weight` of rms_norm(h) * norm_weight, h = the fp32 sums `partials` [splits, M, K] (a
    projection into the residual stream, unrounded) + residual [M, K], without the row kernel between them
    -> (`gemv`'s output for that operand, h and the normalised row, each [M, K] in the residual's dtype)."""
    splits, m, k = partials.shape
    if residual.shape != (m, k) or residual.stride(-1) != 1 or norm_weight.shape != (k,) or weight.shape[1] != k:
        raise ValueError(f"residual {tuple(residual.shape)} / norm weight {tuple(norm_weight.shape)} / weight "
                         f"{tuple(weight.shape)}: expected ({m}, {k}) with unit last stride / ({k},) / (N, {k})")
    n = weight.shape[0] // 2 if mode == SILU_MUL else weight.shape[0]
    if mode == PARTIALS:
        out = torch.empty((1, m, n), dtype=torch.float32, device=partials.device)
    else:
        out = torch.empty((m, n), dtype=residual.dtype, device=partials.device)
    summed = torch.empty((m, k), dtype=residual.dtype, device=partials.device)
    normed = torch.empty_like(summed)
    if m and n:
        _launch(partials, weight, out, mode, 0,
                (residual, norm_weight, summed, normed, m * k, residual.stride(0), eps), splits)
    return out, summed, normed


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, mode: int, s_xm: int, norm: tuple,
            splits: int) -> None:
    m, n, k = out.shape[-2], out.shape[-1], weight.shape[1]
    r = rows_per_program(k)
    _gemv_kernel[(triton.cdiv(n, r), m)](x, weight, out, n, k, s_xm, weight.stride(0), n, *norm, R=r,
                                         KP=triton.next_power_of_2(k), MODE=mode, SPLITS=splits, num_warps=4,
                                         **pdl_launch(x.device))
