"""The small-M FP8 GEMM on a 16-bit activation it quantizes itself: out = quantize_per_token(a) @ wq^T, scaled.

Why: at decode an FP8 projection's activation is quantized per token by a kernel of its own before the GEMM (the
o projection's by Inductor's, 1.4 us a layer on FP8 Llama-3-8B at batch 1; the down projection's SiLU-mul and
quantization by kiln::silu_mul_quant, one program a row: 3.5 us), a dependent kernel in a chain that is mostly
such kernels at batch 1. Here every program of the GEMM first takes the amax of its rows over the whole K (the
row is a few KB to tens of KB, read from L2 by every program), then quantizes each activation tile as it loads
it, in registers. `silu_mul`: the activation is silu(gate) * up of a [M, 2K] gate_up, rounded as the unfused
graph rounds it. The e4m3 values and scale are those of kiln/models/quant/fp8.py's `quantize_per_token` (the
same fp32 arithmetic), and the tile config and K split are `pick_config`'s for the shape, so the sums are the
ones kiln::fp8_gemm forms from the separately quantized activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start
from kiln.models.quant.fp8 import FP8_MAX, MIN_SCALE
from kiln.models.quant.fp8_gemm import use_triton_kernel
from kiln.models.quant.fp8_kernel import (
    Fp8GemmConfig,
    block_m_for,
    flat_scales,
    num_sms,
    pick_config,
    reduce_split_k,
    split_k,
)

# The largest M whose activation the GEMM quantizes itself, plain and SiLU-mul: every program reads its rows' whole
# K for their amax, a cost that grows with M while the kernel it saves does not.
QUANTIZING_MAX_M = {False: 16, True: 16}


def quantizes_in_gemm(a: torch.Tensor, silu_mul: bool) -> bool:
    """Whether this activation is quantized inside the small-M GEMM (else by a kernel of its own before it)."""
    return use_triton_kernel(a) and a.shape[0] <= QUANTIZING_MAX_M[silu_mul]


@triton.jit
def _activation(a_ptr, offs_m, offs_k, mask, s_am, K, SILU_MUL: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] activation tile in fp32, rounded to a's dtype where the unfused graph rounds."""
    rows = offs_m[:, None].to(tl.int64) * s_am
    if SILU_MUL:
        dtype = a_ptr.dtype.element_ty
        g = tl.load(a_ptr + rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(a_ptr + rows + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * up).to(dtype).to(tl.float32)
    return tl.load(a_ptr + rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _quantizing_gemm_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, xs_ptr, M, N, K, k_steps, s_am, s_wn, s_om, s_op,
                            fp8_max, min_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr,
                            SILU_MUL: tl.constexpr, PDL: tl.constexpr = False):
    """Program (n tile, k split, m tile): its rows' scales from their whole-K amax, then acc[BLOCK_N, BLOCK_M]
    over its K range on the activation quantized tile by tile. Without split-K out [M, N] gets the scaled sums;
    with it, out[split, M, N] the fp32 partials and xs [M] the scales (written by the first n tile and split)."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = m_mask[:, None] & (k0 + offs_k < K)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(_activation(a_ptr, offs_m, k0 + offs_k, mask, s_am, K, SILU_MUL)), 1))
    scale = tl.maximum(amax / fp8_max, min_scale)
    k_lo = pid_k * k_steps * BLOCK_K
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_steps):
        ks = k_lo + step * BLOCK_K + offs_k
        k_mask = ks < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        a = _activation(a_ptr, offs_m, ks, m_mask[:, None] & k_mask[None, :], s_am, K, SILU_MUL)
        q = tl.minimum(tl.maximum(a / scale[:, None], -fp8_max), fp8_max).to(w_ptr.dtype.element_ty)
        acc = tl.dot(w, tl.trans(q), acc, max_num_imprecise_acc=32)  # kiln::fp8_gemm's promotion, its sums
        w_ptrs += BLOCK_K
    out_mask = n_mask[:, None] & m_mask[None, :]
    out_offs = offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * s_op + out_offs, acc, mask=out_mask)
        if pid_n == 0 and pid_k == 0:
            tl.store(xs_ptr + offs_m, scale, mask=m_mask)
    else:
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        y = acc * scale[None, :] * ws[:, None]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantizing_gemm(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, silu_mul: bool,
                    out_dtype: torch.dtype = torch.bfloat16, partials: bool = False,
                    config: Fp8GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """a [M, K] (silu_mul: [M, 2K] gate | up) 16-bit, weight [N, K] e4m3, weight_scale [N] fp32 ->
    (out [M, N] in out_dtype, None) or, `partials`, (fp32 [splits, M, N] sums, unscaled, and the [M] scales) for
    a kernel after it to finish, as kiln/models/quant/fp8_kernel.py's `gemm_partials`."""
    m = a.shape[0]
    k = a.shape[1] // 2 if silu_mul else a.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != k or a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"a {tuple(a.shape)} / weight {tuple(weight.shape)}: K mismatch or not K-contiguous")
    config = config or pick_config(m, n, k, num_sms(a.device))
    splits, k_steps, _ = split_k(k, config, config.split_k)
    split = partials or splits > 1
    out = torch.empty((splits, m, n) if split else (m, n), dtype=torch.float32 if split else out_dtype,
                      device=a.device)
    scales = torch.empty(m, dtype=torch.float32, device=a.device)
    if m:
        block_m = block_m_for(m)
        _quantizing_gemm_kernel[(triton.cdiv(n, config.block_n), splits, triton.cdiv(m, block_m))](
            a, weight, weight_scale.reshape(-1).float(), out, scales, m, n, k, k_steps, a.stride(0), weight.stride(0),
            n, m * n, FP8_MAX, MIN_SCALE, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            SPLIT=split, EVEN_N=n % config.block_n == 0, SILU_MUL=silu_mul, num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl_launch(a.device))
    if partials:
        return out, scales
    if split:  # the split-K partials summed in order and scaled, as kiln::fp8_gemm's reduce does
        summed = torch.empty((m, n), dtype=out_dtype, device=a.device)
        reduce_split_k(out, flat_scales(scales, weight_scale), summed)
        return summed, None
    return out, None
