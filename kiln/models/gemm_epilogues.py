"""Decode-sized GEMMs that finish the element-wise step after them.

At batch 1 a decode step is a chain of kernels that each wait for the one before; after PDL (docs/cuda_graphs.md)
SmolLM2-135M's 346 kernels a step still cost ~2 us each, so a kernel that only reshapes a GEMM's output is worth
folding into the GEMM. Two 16-bit kernels here run the small-M GEMM's K loop (kiln/models/quant/fp8_kernel.py,
`accumulate`) on a tile whose weight rows come in two halves that the epilogue pairs in registers:

- `gate_up_silu_mul_triton`: BLOCK_N / 2 gate rows and the up rows N below them -> silu(gate) * up, [M, N];
- `qkv_rope_triton`: inside one head, BLOCK_N / 2 rows of its first half and the rows HEAD_DIM / 2 below them ->
  the neox rotation of q and k by each token's cos/sin (v as it is), written as three contiguous tensors.

Where the step after needs a whole row (a norm), the small-M GEMM writes fp32 sums and a kernel a row finishes:

- `gemm_add_rms_norm_triton`: a projection whose output joins the residual stream (o, down) -> the GEMM's fp32
  sums (split-K partials, or one whole-K "partial"), then one program per row sums them, adds the residual and
  RMS-normalises the row for the next layer: the split-K reduce and the add + norm kernel after it become one;
- `fp8_gemm_add_rms_norm_quant_triton`: the same for an FP8 projection, the row kernel also applying the GEMM's
  scales and quantizing the normalised row per token for the next FP8 projection.

The work sits after the sums, so the GEMM's operands stay plain asynchronous loads (the activation computed in the
down GEMM's operand loads instead cost Llama-3-8B 8% at batch 1: docs/passes.md). Values are rounded where
Inductor's kernels for the unfused graph round them: the GEMM's output to the model dtype, then the SiLU-mul or
the rotation in fp32 to the stored result. Tile configs are
the plain GEMM's for the same weight (`pick_config`), without split-K: an epilogue needs whole sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models import gemv
from kiln.models.pdl import pdl_launch, pdl_start
from kiln.models.quant.fp8_kernel import (
    Fp8GemmConfig,
    accumulate,
    block_m_for,
    check_operands,
    flat_scales,
    gemm_partials,
    num_sms,
    pick_config,
    split_k,
)


@triton.jit
def _halves(acc, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] -> (rows [0, BLOCK_N/2), rows [BLOCK_N/2, BLOCK_N)), each rounded to `dtype` as the
    GEMM's output would be, then widened to fp32."""
    pairs = tl.reshape(acc.to(dtype).to(tl.float32), (2, BLOCK_N // 2, BLOCK_M))
    return tl.split(tl.permute(pairs, (1, 2, 0)))


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_mul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_steps, s_xm, s_wn, s_om, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                             EVEN_N: tl.constexpr, PDL: tl.constexpr = False):
    """Program (tile, m tile): out[m, c] = silu(gate[c]) * up[c] for its BLOCK_N / 2 columns c."""
    pdl_start(PDL)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.program_id(0) * (BLOCK_N // 2) + rows % (BLOCK_N // 2)  # the output column each weight row feeds
    n_mask = cols < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = accumulate(x_ptr, w_ptr, cols + (rows // (BLOCK_N // 2)) * N, n_mask, offs_m, m_mask, K, 0, k_steps,
                     s_xm, s_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, False, 0)
    dtype = out_ptr.dtype.element_ty
    gate, up = _halves(acc, dtype, BLOCK_N, BLOCK_M)
    act = gate * tl.sigmoid(gate)  # in fp32 to the product, as Inductor compiles silu(gate) * up
    out_n = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * s_om + out_n[:, None], (act * up).to(dtype),
             mask=(out_n < N)[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(x_ptr, w_ptr, pos_ptr, cs_ptr, q_ptr, k_ptr, v_ptr, M, K, k_steps, s_xm, s_wn, s_cs,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (tile, m tile): head `head`'s dims d (BLOCK_N / 2 of its first half) and d + HEAD_DIM / 2."""
    pdl_start(PDL)
    tiles = HEAD_DIM // BLOCK_N  # tiles per head
    head = tl.program_id(0) // tiles
    d = (tl.program_id(0) % tiles) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    rows = tl.arange(0, BLOCK_N)
    offs_n = head * HEAD_DIM + (tl.program_id(0) % tiles) * (BLOCK_N // 2) + rows % (BLOCK_N // 2) \
        + (rows // (BLOCK_N // 2)) * (HEAD_DIM // 2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = accumulate(x_ptr, w_ptr, offs_n, offs_n >= 0, offs_m, m_mask, K, 0, k_steps, s_xm, s_wn, BLOCK_M,
                     BLOCK_N, BLOCK_K, EVEN_K, True, False, 0)
    dtype = q_ptr.dtype.element_ty
    x1, x2 = _halves(acc, dtype, BLOCK_N, BLOCK_M)
    rows_m = offs_m[None, :].to(tl.int64)
    if head < NUM_HEADS + NUM_KV_HEADS:  # q and k rotate: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        cs = cs_ptr + pos[None, :] * s_cs + d[:, None]
        cos = tl.load(cs, mask=m_mask[None, :], other=0.0)
        sin = tl.load(cs + HEAD_DIM // 2, mask=m_mask[None, :], other=0.0)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
    else:
        o1 = x1
        o2 = x2
    if head < NUM_HEADS:
        dst = q_ptr + rows_m * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[:, None]
    elif head < NUM_HEADS + NUM_KV_HEADS:
        dst = k_ptr + rows_m * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_HEADS) * HEAD_DIM + d[:, None]
    else:
        dst = v_ptr + rows_m * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM + d[:, None]
    tl.store(dst, o1.to(dtype), mask=m_mask[None, :])
    tl.store(dst + HEAD_DIM // 2, o2.to(dtype), mask=m_mask[None, :])


def fits_a_tile(head_dim: int) -> bool:
    """Whether qkv_rope_triton's tiles can split heads of this size: a power of two of at least 16 (the smallest
    MMA side), so the GEMM's tile (a power of two) either holds whole heads' halves or divides a head."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def gate_up_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor,
                            config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x [M, K], weight [2N, K] (gate rows, then up rows) -> silu(x gate^T) * (x up^T), [M, N] in x's dtype."""
    check_operands(x, weight)
    if weight.shape[0] % 2:
        raise ValueError(f"weight: {weight.shape[0]} rows, expected gate and up halves of equal size")
    m, k = x.shape
    n = weight.shape[0] // 2
    if config is None and gemv.applies(m, 2 * n, k, x.element_size()):
        return gemv.gemv(x, weight, gemv.SILU_MUL)
    config = config or pick_config(m, 2 * n, k, num_sms(x.device), x.element_size())
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _, k_steps, even_k = split_k(k, config, 1)  # the epilogue needs whole sums
    block_m = block_m_for(m)
    grid = (triton.cdiv(n, config.block_n // 2), triton.cdiv(m, block_m))
    _gate_up_silu_mul_kernel[grid](x, weight, out, m, n, k, k_steps, x.stride(0), weight.stride(0), out.stride(0),
                                   BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=even_k,
                                   EVEN_N=n % (config.block_n // 2) == 0, num_warps=config.num_warps,
                                   num_stages=config.num_stages, **pdl_launch(x.device))
    return out


def _gemv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv_rope_triton's result for a weight the plain projection takes through kiln/models/gemv.py: its sums
    (the plain GEMM's), then the kernel's rotation in fp32, so turning the pass on changes no value."""
    from kiln.models.layers import rotate_neox

    m, head_dim = x.shape[0], cos_sin_cache.shape[-1]
    y = gemv.gemv(x, weight).view(m, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = cos_sin_cache[positions[:m]].float()[:, None].chunk(2, dim=-1)
    rotated = rotate_neox(y[:, :num_heads + num_kv_heads], cos, sin)
    # copies, not `.contiguous()`: at one token the slices are contiguous already, and the op's outputs may not alias
    fmt = torch.contiguous_format
    return (rotated[:, :num_heads].clone(memory_format=fmt), rotated[:, num_heads:].clone(memory_format=fmt),
            y[:, num_heads + num_kv_heads:].clone(memory_format=fmt))


def qkv_rope_triton(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    num_heads: int, num_kv_heads: int,
                    config: Fp8GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], weight [(H + 2 Hkv) D, K] (q, k, v rows), positions [>= M], cos_sin_cache [P, D] (cos then sin)
    -> (q [M, H, D], k [M, Hkv, D] rotated, v [M, Hkv, D]), contiguous, in x's dtype."""
    check_operands(x, weight)
    m, k = x.shape
    head_dim = cos_sin_cache.shape[-1]
    n = weight.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"weight: {n} rows, expected ({num_heads} + 2 x {num_kv_heads}) heads of {head_dim}")
    if config is None and gemv.applies(m, n, k, x.element_size()) and fits_a_tile(head_dim):
        return _gemv_rope(x, weight, positions, cos_sin_cache, num_heads, num_kv_heads)
    config = config or pick_config(m, n, k, num_sms(x.device), x.element_size())
    block_n = min(config.block_n, head_dim)  # a tile stays inside one head
    if not fits_a_tile(head_dim) or head_dim % block_n:
        raise ValueError(f"head_dim {head_dim}: not a power of two of at least 16, which the tiles need")
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    k_out = torch.empty((m, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    v = torch.empty_like(k_out)
    if m == 0:
        return q, k_out, v
    _, k_steps, even_k = split_k(k, config, 1)  # the epilogue needs whole sums
    block_m = block_m_for(m)
    _qkv_rope_kernel[(n // block_n, triton.cdiv(m, block_m))](
        x, weight, positions, cos_sin_cache, q, k_out, v, m, k, k_steps, x.stride(0), weight.stride(0),
        cos_sin_cache.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=config.block_k, EVEN_K=even_k, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_launch(x.device))
    return q, k_out, v


@triton.jit
def _add_rms_norm_rows_kernel(p_ptr, xs_ptr, ws_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, sum_ptr, N, s_p, s_res, eps,
                              fp8_max, min_scale, SPLIT_K: tl.constexpr, SCALED: tl.constexpr, QUANT: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program m: h = round(sum over splits, in order, of partial[s, m] [* x_scale[m] * w_scale]) + residual[m],
    rounded (the plain GEMM's output, then the add, as the unfused graph rounds them); y = w * round(h * rsqrt(mean(h^2)
    + eps)), written as it is or (QUANT) quantized per token as quantize_per_token does: scale = max(amax|y| / 448,
    min_scale), e4m3(clamp(y / scale)). The weights (norm and scales) are loaded before the PDL wait: no kernel of a
    step writes them, and loaded after the row's reduction they cost a DRAM round trip of their own."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        ws = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    else:  # unread
        ws = w
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    acc = tl.load(p_ptr + row * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * s_p + row * N + offs, mask=mask, other=0.0)
    if SCALED:  # in the order the FP8 GEMM applies its scales
        acc = acc * tl.load(xs_ptr + row) * ws
    dtype = sum_ptr.dtype.element_ty
    res = tl.load(res_ptr + row * s_res + offs, mask=mask, other=0.0).to(tl.float32)
    h = (acc.to(dtype).to(tl.float32) + res).to(dtype)
    tl.store(sum_ptr + row * N + offs, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(hf * hf, 0) / N + eps)  # Inductor's arithmetic for the unfused norm
    y = (w * (hf * inv).to(dtype).to(tl.float32)).to(dtype)
    if QUANT:
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), 0) / fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(yf / scale, -fp8_max), fp8_max)
        tl.store(out_ptr + row * N + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * N + offs, y, mask=mask)


def _gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                       residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, quant: bool,
                       config: Fp8GemmConfig | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """-> (normed [M, N] in the residual's dtype, or its e4m3 values; their [M, 1] scale or None; h)."""
    from kiln.models.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

    check_operands(x, weight)
    m, n = x.shape[0], weight.shape[0]
    if residual.shape != (m, n) or residual.stride(-1) != 1 or norm_weight.shape != (n,):
        raise ValueError(f"residual {tuple(residual.shape)} / norm weight {tuple(norm_weight.shape)}: expected "
                         f"({m}, {n}) with unit last stride / ({n},)")
    summed = torch.empty((m, n), dtype=residual.dtype, device=x.device)
    out = torch.empty((m, n), dtype=FP8_DTYPE if quant else residual.dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device) if quant else None
    if m == 0:
        return out, scale, summed
    scales = flat_scales(*scales) if scales is not None else None
    partials = gemm_partials(x, weight, scales, config)  # fp32 sums, even with one split
    split = partials.shape[0]
    xs, ws = scales if scales is not None else (partials, partials)  # unread without scales
    block = triton.next_power_of_2(n)
    _add_rms_norm_rows_kernel[(m,)](partials, xs, ws, residual, norm_weight, out, scale if quant else partials, summed,
                                    n, m * n, residual.stride(0), eps, FP8_MAX, MIN_SCALE, SPLIT_K=split,
                                    SCALED=scales is not None, QUANT=quant, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)), **pdl_launch(x.device))
    return out, scale, summed


def gemm_add_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                             eps: float, config: Fp8GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]^T + residual [M, N] -> (rms_norm(h) * norm_weight, h), both [M, N] in x's dtype.
    The GEMM sums as kiln::dense_gemm's small-M kernel does for this shape (its config and split), so h is what the
    unfused graph's GEMM and add give."""
    normed, _, summed = _gemm_add_rms_norm(x, weight, None, residual, norm_weight, eps, False, config)
    return normed, summed


def fp8_gemm_add_rms_norm_quant_triton(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor,
                                       weight_scale: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                       eps: float, config: Fp8GemmConfig | None = None,
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 projection into the residual stream: q [M, K] e4m3 with x_scale [M, 1], weight [N, K] e4m3 with
    weight_scale [N] -> (e4m3 [M, N] and its fp32 [M, 1] scale: quantize_per_token(rms_norm(h) * norm_weight), h in
    the residual's dtype), summed as kiln::fp8_gemm's small-M kernel does for this shape."""
    out, scale, summed = _gemm_add_rms_norm(q, weight, (x_scale, weight_scale), residual, norm_weight, eps, True,
                                            config)
    assert scale is not None
    return out, scale, summed
