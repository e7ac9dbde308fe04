"""A decode-sized GEMM whose operand is the RMSNorm that the projection before it left unfinished.

kiln::gemm_add_rms_norm ends a projection into the residual stream (o, down) with a kernel a row that sums the
GEMM's fp32 partials, adds the residual and normalises (kiln/models/gemm_epilogues.py). At batch 1 that kernel
only waits, twice a layer, for the GEMM before it and holds up the GEMM after it, which is all its output feeds:
the layer's gate_up (with SiLU-mul) or the next layer's qkv. Here that next GEMM does the row kernel's work as it
loads its operand. For each K tile it sums the partials in split order and adds the residual, rounding as the row
kernel rounds: that is h, which the programs of the first N tile write out for the residual stream. It multiplies
h by the norm weight into the MMA's operand, accumulates h^2 beside the dot (element-wise: one reduction along K
after the loop, not a cross-thread one every step), and scales the finished sums by the row's 1 / rms.

The norm's rounding therefore moves: the unfused graph rounds h * rstd, then its product with the weight, to 16
bits before the GEMM; here h * weight is rounded and rstd scales the fp32 sums. The operands differ by about an
ulp, so the result is not bit-identical to the two kernels'. Only configs without split-K qualify (a split sees
part of the row, and the norm needs all of it): `whole_rows_config` says which; the op falls back to two kernels
otherwise (kiln/passes/ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.gemm_epilogues import halves
from kiln.models.pdl import pdl_launch, pdl_start
from kiln.models.quant.fp8_kernel import (
    Fp8GemmConfig,
    block_m_for,
    load_weight_tile,
    num_sms,
    pick_config,
    split_k,
)


@triton.jit(do_not_specialize=["M"])
def _rmsnorm_gemm_kernel(p_ptr, res_ptr, g_ptr, w_ptr, out_ptr, h_ptr, M, N, K, k_steps, s_p, s_res, s_wn, s_om, eps,
                         SPLIT_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SILU_MUL: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program (n tile, m tile): out = (w * h) W^T / rms(h) for its tile, h = round(sum of the SPLIT_P partials
    [s, m, k]) + residual[m, k]; SILU_MUL: the tile's rows are gate rows and the up rows N below them, and it writes
    silu(gate) * up for its BLOCK_N / 2 columns, as kiln::gate_up_silu_mul's kernel does."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    if SILU_MUL:
        cols = pid_n * (BLOCK_N // 2) + rows % (BLOCK_N // 2)
        n_mask = cols < N
        offs_n = cols + (rows // (BLOCK_N // 2)) * N
    else:
        offs_n = pid_n * BLOCK_N + rows
        n_mask = offs_n < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    row = offs_m[:, None].to(tl.int64)
    dtype = h_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # summed along K once, after the loop
    for step in range(0, k_steps):
        k = step * BLOCK_K + offs_k
        w, x_mask = load_weight_tile(w_ptrs, n_mask, m_mask, k, K, EVEN_K, EVEN_N)
        part = tl.load(p_ptr + row * K + k[None, :], mask=x_mask, other=0.0)
        for s in tl.static_range(1, SPLIT_P):
            part += tl.load(p_ptr + s * s_p + row * K + k[None, :], mask=x_mask, other=0.0)
        res = tl.load(res_ptr + row * s_res + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        h = (part.to(dtype).to(tl.float32) + res).to(dtype)
        if pid_n == 0:
            tl.store(h_ptr + row * K + k[None, :], h, mask=x_mask)
        hf = h.to(tl.float32)
        squares += hf * hf
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc = tl.dot(w, tl.trans((hf * g[None, :]).to(w_ptr.dtype.element_ty)), acc)
        w_ptrs += BLOCK_K
    acc = acc * tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)[None, :]
    if SILU_MUL:
        gate, up = halves(acc, dtype, BLOCK_N, BLOCK_M)
        y = gate * tl.sigmoid(gate) * up  # in fp32 to the product, as Inductor compiles silu(gate) * up
        out_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * s_om + out_n[:, None], y.to(dtype),
                 mask=(out_n < N)[:, None] & m_mask[None, :])
    else:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * s_om + offs_n[:, None], acc.to(dtype),
                 mask=n_mask[:, None] & m_mask[None, :])


def config_for(m: int, weight: torch.Tensor) -> Fp8GemmConfig:
    """The tile config kiln::dense_gemm / kiln::gate_up_silu_mul's kernel takes for this weight at M tokens."""
    return pick_config(m, weight.shape[0], weight.shape[1], num_sms(weight.device), weight.element_size())


def whole_rows_config(m: int, weight: torch.Tensor) -> Fp8GemmConfig | None:
    """The next projection's config if it sums whole rows of K in one program (no split-K), else None."""
    config = config_for(m, weight)
    return config if split_k(weight.shape[1], config, config.split_k)[0] == 1 else None


def rmsnorm_gemm_triton(partials: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, silu_mul: bool,
                        config: Fp8GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """partials [S, M, K] fp32 (a projection's sums), residual [M, K], norm_weight [K], weight [N', K] ->
    (rms_norm(h) * norm_weight @ weight^T, or with silu_mul silu(gate) * up of its halves; h = round(sum of the
    partials) + residual), both in the residual's dtype."""
    splits, m, k = partials.shape
    if residual.shape != (m, k) or residual.stride(-1) != 1 or norm_weight.shape != (k,) or weight.shape[1] != k:
        raise ValueError(f"residual {tuple(residual.shape)} / norm weight {tuple(norm_weight.shape)} / weight "
                         f"{tuple(weight.shape)}: expected ({m}, {k}) with unit last stride / ({k},) / (N, {k})")
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"weight: {weight.shape[0]} rows, expected gate and up halves of equal size")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((m, n), dtype=residual.dtype, device=residual.device)
    h = torch.empty((m, k), dtype=residual.dtype, device=residual.device)
    if m == 0:
        return out, h
    config = config or config_for(m, weight)
    _, k_steps, even_k = split_k(k, config, 1)
    block_m = block_m_for(m)
    tile_n = config.block_n // 2 if silu_mul else config.block_n
    _rmsnorm_gemm_kernel[(triton.cdiv(n, tile_n), triton.cdiv(m, block_m))](
        partials, residual, norm_weight, weight, out, h, m, n, k, k_steps, m * k, residual.stride(0),
        weight.stride(0), out.stride(0), eps, SPLIT_P=splits, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=even_k, EVEN_N=n % tile_n == 0, SILU_MUL=silu_mul,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(residual.device))
    return out, h
