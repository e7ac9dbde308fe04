"""Triton kernels behind the fused ops (kiln/passes/ops.py) on CUDA; imported only when one runs there.

Each reproduces the model's casts: in bf16/fp16 a norm's `x.to(dtype)` and `weight * x` round to the
model dtype before RoPE reads the value back in fp32, exactly as the unfused graph does. Last-dim stride
1 is required of every tensor (the ops' callers guarantee it or copy); other strides are passed in. Each takes
part in programmatic dependent launch (kiln/models/pdl.py) like the step's other Triton kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start
from kiln.models.rope_triton import rotate


@triton.jit
def _fp8_units(x, scale):
    """x -> clamp(x / scale, +-448) in fp32, ready for the cast to e4m3 (kiln/models/kv_quant.py)."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)


@triton.jit
def _norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slot_ptr,
                      cache_ptr, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_qot, s_qoh, s_kot, s_koh, s_vot, s_voh, s_cs,
                      s_cb, s_ckv, s_cp, s_ch, num_q_heads, eps, k_scale, v_scale,
                      HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
                      NORM: tl.constexpr, TO_CACHE: tl.constexpr, KV_FP8: tl.constexpr, V_OUT: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """One program per (token, head) over q heads then k heads: [norm,] rotate, store q' / (k', v) -> cache.

    KV_FP8: the cache is e4m3; k' (rounded to the model dtype first, as the unfused path does) and v are
    stored as clamp(x / scale, +-448) (kiln/models/kv_quant.py). V_OUT (without the cache): a k head's program
    also copies the token's v head to v_out (a contiguous v, as the model's v.contiguous() makes). Every load is
    issued before the norm's reduction, the weights before the PDL wait (kiln/models/pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    is_q = h < num_q_heads
    if is_q:
        src = q_ptr + t * s_qt + h * s_qh
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * s_kt + (h - num_q_heads) * s_kh
        w_ptr = kw_ptr
    if NORM:
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0)
    dtype = q_ptr.dtype.element_ty
    if NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = rotate(x1, -x2, cos, sin).to(dtype)
    o2 = rotate(x2, x1, cos, sin).to(dtype)
    if is_q:
        dst = q_out_ptr + t * s_qot + h * s_qoh
        tl.store(dst + offs, o1, mask=mask)
        tl.store(dst + HALF + offs, o2, mask=mask)
    else:
        kh = h - num_q_heads
        if TO_CACHE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:  # a negative slot means "no write", as for the backends' own writes
                dst = cache_ptr + (slot // PAGE) * s_cb + (slot % PAGE) * s_cp + kh * s_ch
                vsrc = v_ptr + t * s_vt + kh * s_vh
                v1 = tl.load(vsrc + offs, mask=mask)
                v2 = tl.load(vsrc + HALF + offs, mask=mask)
                # new names: a value from before this runtime `if` may not change type inside it (Triton on a
                # GPU rejects it; the interpreter does not)
                k1, k2 = o1, o2
                if KV_FP8:
                    k1 = _fp8_units(o1, k_scale)
                    k2 = _fp8_units(o2, k_scale)
                    v1 = _fp8_units(v1, v_scale)
                    v2 = _fp8_units(v2, v_scale)
                tl.store(dst + offs, k1.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + HALF + offs, k2.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + s_ckv + offs, v1.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + s_ckv + HALF + offs, v2.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            dst = k_out_ptr + t * s_kot + kh * s_koh
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + HALF + offs, o2, mask=mask)
            if V_OUT:
                vsrc = v_ptr + t * s_vt + kh * s_vh
                vdst = v_out_ptr + t * s_vot + kh * s_voh
                tl.store(vdst + offs, tl.load(vsrc + offs, mask=mask), mask=mask)
                tl.store(vdst + HALF + offs, tl.load(vsrc + HALF + offs, mask=mask), mask=mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0,
                     v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], k [T, Hkv, D] -> (q', k'), or (q', None) with k' and v written to kv_cache at slots; with
    v_out (and v, no cache) v is also copied into v_out [T, Hkv, D] in the same launch."""
    q, k = _unit_last(q), _unit_last(k)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    to_cache = kv_cache is not None
    k_out = None if to_cache else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    norm = q_weight is not None and k_weight is not None
    cache = kv_cache if to_cache else q_out  # placeholders for pointers a branch never touches
    vv = _unit_last(v) if v is not None else q
    kv_strides = (cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)) if to_cache else (0, 0, 0, 0)
    ko = k_out if k_out is not None else q_out
    vo = v_out if v_out is not None and v is not None and not to_cache else q_out
    half = head_dim // 2
    _norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q, k, vv, q_weight if norm else q, k_weight if norm else q, positions, cos_sin_cache, q_out, ko, vo,
        slot_mapping if to_cache else positions, cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        q_out.stride(0), q_out.stride(1), ko.stride(0), ko.stride(1), vo.stride(0), vo.stride(1),
        cos_sin_cache.stride(0), *kv_strides,
        num_q_heads, eps, float(k_scale), float(v_scale), HEAD_DIM=head_dim, HALF=half,
        BLOCK=triton.next_power_of_2(half), PAGE=cache.shape[2] if to_cache else 1, NORM=norm, TO_CACHE=to_cache,
        KV_FP8=to_cache and cache.dtype == torch.float8_e4m3fn, V_OUT=vo is not q_out, num_warps=1,
        **pdl_launch(q.device))
    return q_out, k_out


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, s_x, s_r, s_o, s_s, n, eps,
                         BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr = False):
    """One program per row, the whole row in registers: one read of x (and r), one write of each output; the norm's
    weight loaded before the PDL wait (kiln/models/pdl.py)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * s_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (w * (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_o + offs, y, mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, N] (+ residual) -> (rms_norm(x [+ residual]), x + residual or None)."""
    x = _unit_last(x)
    rows, n = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if rows == 0:
        return out, summed
    r = _unit_last(residual) if residual is not None else x
    s = summed if summed is not None else out
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](x, r, weight, out, s, x.stride(0), r.stride(0), out.stride(0), s.stride(0), n, eps,
                                  BLOCK=block, ADD=residual is not None,
                                  num_warps=min(16, max(1, block // 256)), **pdl_launch(x.device))
    return out, summed


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_x, s_o, n, BLOCK: tl.constexpr, ROUND_ACT: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    g = tl.load(x_ptr + row * s_x + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + n + col, mask=mask, other=0.0).to(tl.float32)
    if ROUND_ACT:  # eager torch: F.silu returns the model dtype
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    else:  # Inductor's kernel for the same graph keeps fp32 to the product
        act = g * tl.sigmoid(g)
    tl.store(out_ptr + row * s_o + col, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, round_act: bool = True) -> torch.Tensor:
    """x [..., 2N] -> silu(x[..., :N]) * x[..., N:]; round_act: the SiLU rounded to x's dtype before the product
    (eager torch's arithmetic), else fp32 to the end (Inductor's)."""
    lead = x.shape[:-1]
    x = _unit_last(x.reshape(-1, x.shape[-1]))
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                        ROUND_ACT=round_act, num_warps=4, **pdl_launch(x.device))
    return out.reshape(*lead, n)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, s_x, s_q, n, fp8_max, min_scale, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
    """One program per row, the whole row in registers: gate and up read once, the e4m3 row and its scale
    written once (the unfused graph reads the SiLU-mul's inputs twice: once for the amax, once to quantize)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    y = (act * up).to(dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), 0) / fp8_max, min_scale)
    q = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
    tl.store(q_ptr + row * s_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_mul_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2N] = [gate | up] -> (e4m3 [T, N], fp32 [T, 1]): the per-token quantization of silu(gate) * up."""
    from kiln.models.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

    x = _unit_last(x)
    rows, n = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _silu_mul_quant_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n, FP8_MAX, MIN_SCALE, BLOCK=block,
                                        num_warps=min(16, max(4, block // 512)), **pdl_launch(x.device))
    return q, scale
