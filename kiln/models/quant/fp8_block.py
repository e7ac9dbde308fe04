"""An FP8 GEMM for decode-sized M that quantizes its 16-bit activation itself, one scale per 1 x 128 block.

Why: with a scale per token, the activation's quantization needs the whole row's amax before the GEMM can start,
so an FP8 layer at batch 1 runs a quantization kernel (or a norm kernel that also quantizes) in front of each of
its four projections: on the H200 the FP8 Llama-3-8B layer's row, quantization and SiLU-mul-quantization kernels
took 12.3 of its 81.5 us (docs/passes.md). A quantizing GEMM that streamed the whole row first was measured and
removed (every program waits for the row before its weights). With a scale per block of 128 activations along K,
a program quantizes each K tile as it loads it: the tile's own amax, no pass over the row, no kernel in front. The
price is in the loop: the MMA of each K step lands in a fresh accumulator that is scaled by the block's scale and
added to the running sum in fp32 (the weight's per-channel scale stays in the epilogue).

The arithmetic (`block_scaled_reference`, the CPU path and the tests' oracle): scale = max(amax / 448, MIN_SCALE)
per (token, block of 128 along K; the last block may be short), q = clamp(x / scale) in e4m3, and
out[m, n] = sum over blocks (q . w_q over the block) * scale * w_scale[n].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start
from kiln.models.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kiln.models.quant.fp8_kernel import (
    Fp8GemmConfig,
    block_m_for,
    check_operands,
    load_weight_tile,
    num_sms,
    pick_config,
    reduce_splits,
    split_k,
)

GROUP = 128  # activations per scale along K: one K tile of the kernel


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> ([M, K] e4m3, [M, ceil(K / 128)] fp32 scales), one scale per block of 128 along K."""
    m, k = x.shape
    blocks = triton.cdiv(k, GROUP)
    padded = torch.zeros(m, blocks * GROUP, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    grouped = padded.view(m, blocks, GROUP)
    scale = (grouped.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, blocks * GROUP)[:, :k], scale


def block_scaled_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel's arithmetic in torch: x [M, K] 16/32-bit, weight [N, K] e4m3, weight_scale [N] -> [M, N]."""
    q, scale = quantize_blocks(x)
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for b in range(scale.shape[1]):
        cols = slice(b * GROUP, (b + 1) * GROUP)
        acc += (q[:, cols].float() @ weight[:, cols].float().t()) * scale[:, b:b + 1]
    return (acc * weight_scale.float().reshape(1, -1)).to(out_dtype)


@triton.jit
def round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the cast after it is
    exact. Rounded here because Triton's interpreter casts 126.3 to 64 (a rounding that carries into the exponent
    loses the carry); on the GPU the same instructions' cost is small beside the weight stream."""
    bits = y.to(tl.int32, bitcast=True)  # normal range: keep 3 of fp32's 23 mantissa bits
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (y + 24576.0) - 24576.0  # below 2^-6, multiples of 2^-9: 24576 = 1.5 * 2^14 has that ulp
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def quantize_tile(x):
    """x [BLOCK_M, 128] fp32 -> (its e4m3 tile, [BLOCK_M] scales): a scale per row of the tile."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1.0 / (448.0 * 512.0))  # FP8_MAX, MIN_SCALE
    q = tl.clamp(round_to_e4m3(x / scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def dot_block_scaled(acc, w, x):
    """acc[BLOCK_N, BLOCK_M] + W tile . x tile^T with x (fp32 [BLOCK_M, 128]) quantized per row on the way."""
    q, scale = quantize_tile(x)
    return acc + tl.dot(w, tl.trans(q), max_num_imprecise_acc=32) * scale[None, :]


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, k_steps, s_xm, s_wn, s_om, s_op,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                           EVEN_N: tl.constexpr, PDL: tl.constexpr = False):
    """Program (n tile, k split, m tile), the small-M FP8 kernel's grid: acc over its K range with each 128-wide
    activation tile quantized as loaded. Without split-K out [M, N] = acc * w_scale in out's dtype; with it the
    block-scaled fp32 partials go to out[split, M, N]."""
    BLOCK_K: tl.constexpr = 128
    pdl_start(PDL)
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * k_steps * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * s_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_steps):
        w, x_mask = load_weight_tile(w_ptrs, n_mask, m_mask, k_lo + step * BLOCK_K + offs_k, K, EVEN_K, EVEN_N)
        acc = dot_block_scaled(acc, w, tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = n_mask[:, None] & m_mask[None, :]
    out_offs = offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * s_op + out_offs, acc, mask=out_mask)
    else:
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(out_ptr + out_offs, (acc * ws[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


def block_config(m: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig:
    """The per-token kernel's config for the shape with its K tile made one block (the same split)."""
    config = pick_config(m, n, k, num_sms(device))
    return Fp8GemmConfig(config.block_n, GROUP, config.split_k, config.num_warps, config.num_stages)


def fp8_block_gemm_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] 16-bit, weight [N, K] e4m3, weight_scale [N] fp32 -> [M, N]: block_scaled_reference's result."""
    check_operands(x, weight)
    (m, k), n = x.shape, weight.shape[0]
    config = config or block_config(m, n, k, x.device)
    if config.block_k != GROUP:
        raise ValueError(f"config: block_k {config.block_k}, the kernel's K tile is one scale block ({GROUP})")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    split, k_steps, even_k = split_k(k, config, config.split_k)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    ws = weight_scale.reshape(-1).float().contiguous()
    pdl = pdl_launch(x.device)
    _fp8_block_gemm_kernel[(triton.cdiv(n, config.block_n), split, triton.cdiv(m, block_m_for(m)))](
        x, weight, ws, target, m, n, k, k_steps, x.stride(0), weight.stride(0), n, m * n, BLOCK_M=block_m_for(m),
        BLOCK_N=config.block_n, SPLIT=split > 1, EVEN_K=even_k, EVEN_N=n % config.block_n == 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    if split > 1:
        reduce_splits(target, None, ws, out, pdl)
    return out
