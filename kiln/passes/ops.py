"""The custom ops kiln's fusion passes rewrite graphs to, with reference implementations.

The reference code reproduces the model's own arithmetic (kiln/models/layers.py) step for step, dtype
casts included, so a rewritten graph gives the numbers the original gave. On CUDA the ops run the Triton
kernels in kiln/passes/kernels.py instead: one launch where Inductor or the attention backend used two.

`kiln::rope_attention` is a split point like `kiln::attention` (attention_op.register_split_op): it runs
between compiled pieces, where the paged cache and slot mapping of this step are at hand.
"""

from __future__ import annotations

import torch

from kiln.models.attention_op import register_split_op, write_kv
from kiln.models.forward_context import Rope, get_forward_context


def _use_triton(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# -- reference arithmetic (the model's, verbatim in effect) ---------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x [T, H, D] by the cached cos/sin of each token's position."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rope_ref(positions, q, cos_sin_cache), rope_ref(positions, k, cos_sin_cache)


# -- RoPE (+ optional q/k norm) + K/V write + attention from the cache ------------------------------------
@torch.library.custom_op("kiln::rope_attention", mutates_args=("out",))
def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, out: torch.Tensor, layer_idx: int,
                   q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0) -> None:
    """Like kiln::attention on RoPE'd (optionally q/k-normed) q/k: rotated inside the attention kernel where the
    backend can (`supports_rope`, e.g. the Triton decode kernel), else with the rotation and the K/V write done in
    one kernel when the backend can then attend from the cache alone; otherwise the plain path."""
    ctx = get_forward_context()
    if ctx.rope_attention is not None and ctx.rope_attention(
            layer_idx, q, k, v, out, Rope(positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)):
        return
    if ctx.cache_only_attention and ctx.kv_caches is not None and ctx.slot_mapping is not None:
        k_scale, v_scale = ctx.kv_scales[layer_idx] if ctx.kv_scales is not None else (1.0, 1.0)
        q_rot = rope_and_cache(q, k, v, positions, cos_sin_cache, ctx.kv_caches[layer_idx], ctx.slot_mapping,
                               q_norm_weight, k_norm_weight, eps, k_scale, v_scale)
        ctx.attention(layer_idx, q_rot, None, None, out)
        return
    q_rot, k_rot = _norm_rope(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    ctx.attention(layer_idx, q_rot, k_rot, v, out)


@rope_attention.register_fake
def _rope_attention_fake(q, k, v, positions, cos_sin_cache, out, layer_idx, q_norm_weight=None,
                         k_norm_weight=None, eps=0.0) -> None:
    return None


register_split_op(torch.ops.kiln.rope_attention)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                   eps: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """-> rotated q; rotated k and v land in kv_cache (one layer's) at slot_mapping, quantized with the
    layer's scales if the cache is fp8."""
    if _use_triton(q):
        from kiln.passes.kernels import norm_rope_triton

        return norm_rope_triton(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, v=v, kv_cache=kv_cache,
                                slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)[0]
    q_rot, k_rot = norm_rope_ref(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)
    write_kv(k_rot, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q_rot


# -- q/k norm + RoPE, inside a compiled piece ------------------------------------------------------------
@torch.library.custom_op("kiln::qk_norm_rope", mutates_args=())
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_rope(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)


def _norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(q):
        from kiln.passes.kernels import norm_rope_triton

        q_rot, k_rot = norm_rope_triton(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)
        assert k_rot is not None
        return q_rot, k_rot
    return norm_rope_ref(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(q, k, positions, cos_sin_cache, q_weight, k_weight, eps):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


# -- residual add + RMSNorm ---------------------------------------------------------------------------
@torch.library.custom_op("kiln::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        from kiln.passes.kernels import add_rms_norm_triton

        return add_rms_norm_triton(x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("kiln::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual)."""
    return _add_rms_norm(x, residual, weight, eps)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        from kiln.passes.kernels import add_rms_norm_triton

        normed, summed = add_rms_norm_triton(x, residual, weight, eps)
        assert summed is not None
        return normed, summed
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


# -- SiLU-and-mul over the merged gate_up output -----------------------------------------------------------
@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up, [T, N]."""
    if _use_triton(x):
        from kiln.passes.kernels import silu_and_mul_triton

        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@silu_and_mul.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# -- the gate_up GEMM with SiLU-and-mul in its epilogue (16-bit weights) -----------------------------------------
@torch.library.custom_op("kiln::gate_up_silu_mul", mutates_args=())
def gate_up_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [2N, K] = [gate; up] -> silu(x gate^T) * (x up^T), [M, N], the GEMM rounded to x's dtype
    and the rest in fp32 as Inductor compiles the unfused graph. Dispatched on M as kiln::dense_gemm is
    (kiln/models/dense_gemm.py): its small-M kernel computes the activation in the epilogue; larger M (and the CPU)
    run the GEMM, then the SiLU-mul."""
    from kiln.models import dense_gemm

    if x.is_cuda and x.shape[0] <= dense_gemm.TRITON_MAX_M:
        from kiln.models.gemm_epilogues import gate_up_silu_mul_triton

        return gate_up_silu_mul_triton(x, weight)
    gate_up = torch.mm(x, weight.t())
    if _use_triton(x):  # fp32 from the SiLU to the product, as Inductor's kernel for the unfused graph
        from kiln.passes.kernels import silu_and_mul_triton

        return silu_and_mul_triton(gate_up, round_act=False)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@gate_up_silu_mul.register_fake
def _gate_up_silu_mul_fake(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


# -- a projection into the residual stream, the add and the next norm (16-bit; FP8 with the next quantization) ----
@torch.library.custom_op("kiln::gemm_add_rms_norm", mutates_args=())
def gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]^T + residual [M, N] -> (rms_norm(h) * norm_weight, h). Dispatched on M as
    kiln::dense_gemm is: its small-M GEMM writes fp32 sums that one kernel a row adds and normalises; larger M (and
    the CPU) run the GEMM, then the add and norm."""
    from kiln.models import dense_gemm

    if x.is_cuda and x.shape[0] <= dense_gemm.TRITON_MAX_M:
        from kiln.models.gemm_epilogues import gemm_add_rms_norm_triton

        return gemm_add_rms_norm_triton(x, weight, residual, norm_weight, eps)
    return _add_rms_norm(torch.mm(x, weight.t()), residual, norm_weight, eps)


@gemm_add_rms_norm.register_fake
def _gemm_add_rms_norm_fake(x, weight, residual, norm_weight, eps):
    out = x.new_empty((x.shape[0], weight.shape[0]))
    return out, torch.empty_like(out)


def _norm_in_matrix_vector(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, next_weight: torch.Tensor,
                           mode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """gemv.gemv_after_norm's (output, h, normalised row) where the next projection runs the matrix-vector kernel,
    which finishes the row x @ weight^T + residual left unfinished (the sum, the add and the norm); else None."""
    from kiln.models import dense_gemm, gemv

    if not (x.is_cuda and x.shape[0] <= dense_gemm.TRITON_MAX_M
            and gemv.applies(x.shape[0], next_weight.shape[0], next_weight.shape[1], next_weight.element_size())):
        return None
    from kiln.models.quant.fp8_kernel import check_operands, gemm_partials

    check_operands(x, weight)
    return gemv.gemv_after_norm(gemm_partials(x, weight), residual, norm_weight, eps, next_weight, mode)


@torch.library.custom_op("kiln::gemm_add_rms_norm_gemm", mutates_args=())
def gemm_add_rms_norm_gemm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, next_weight: torch.Tensor,
                           silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln::gemm_add_rms_norm's normalised row straight into the next projection -> (that projection's output, h):
    kiln::dense_gemm(normed, next_weight), or with silu_mul kiln::gate_up_silu_mul(normed, next_weight). Where the
    next projection runs the matrix-vector kernel (kiln/models/gemv.py), that kernel finishes the row itself (the sum,
    the add and the norm) before its dot: one kernel fewer; otherwise the two ops."""
    from kiln.models import gemv

    fused = _norm_in_matrix_vector(x, weight, residual, norm_weight, eps, next_weight,
                                   gemv.SILU_MUL if silu_mul else gemv.OUT)
    if fused is not None:
        return fused[0], fused[1]
    normed, summed = gemm_add_rms_norm(x, weight, residual, norm_weight, eps)
    next_op = torch.ops.kiln.gate_up_silu_mul if silu_mul else torch.ops.kiln.dense_gemm
    return next_op(normed, next_weight), summed


@gemm_add_rms_norm_gemm.register_fake
def _gemm_add_rms_norm_gemm_fake(x, weight, residual, norm_weight, eps, next_weight, silu_mul):
    n = next_weight.shape[0] // 2 if silu_mul else next_weight.shape[0]
    return x.new_empty((x.shape[0], n)), x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("kiln::gemm_add_rms_norm_route", mutates_args=())
def gemm_add_rms_norm_route(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, gate_weight: torch.Tensor, top_k: int,
                            renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kiln::gemm_add_rms_norm's normalised row into a MoE layer's router (kiln::moe_route) -> (the routing weights,
    the expert ids, h, the normalised row, which the experts read). Where the router runs the matrix-vector kernel,
    that kernel finishes the row (the sum, the add and the norm) before its dot and writes it for the experts: one
    kernel fewer; otherwise the two ops."""
    from kiln.models import gemv

    fused = _norm_in_matrix_vector(x, weight, residual, norm_weight, eps, gate_weight, gemv.PARTIALS)
    if fused is not None:
        from kiln.models.fused_moe.routing_triton import top_k_of_partials

        logits, summed, normed = fused
        return (*top_k_of_partials(logits, x.dtype, top_k, renormalize), summed, normed)
    from kiln.models.fused_moe.routing import moe_route

    normed, summed = gemm_add_rms_norm(x, weight, residual, norm_weight, eps)
    return (*moe_route(normed, gate_weight, top_k, renormalize), summed, normed)


@gemm_add_rms_norm_route.register_fake
def _gemm_add_rms_norm_route_fake(x, weight, residual, norm_weight, eps, gate_weight, top_k, renormalize):
    shape, h = (x.shape[0], top_k), x.new_empty((x.shape[0], weight.shape[0]))
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32), h, torch.empty_like(h)


@torch.library.custom_op("kiln::fp8_gemm_add_rms_norm_quant", mutates_args=())
def fp8_gemm_add_rms_norm_quant(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor,
                                weight_scale: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 projection (kiln::fp8_gemm, bf16 out) + residual -> (e4m3 values and [M, 1] scale of
    quantize_per_token(rms_norm(h) * norm_weight), h). kiln::fp8_gemm's small-M kernel writes fp32 sums that one
    kernel a row scales, adds, normalises and quantizes; otherwise the GEMM, then the add and norm, then the
    quantization."""
    from kiln.models.quant.fp8 import quantize_per_token
    from kiln.models.quant.fp8_gemm import use_triton_kernel

    if use_triton_kernel(q):
        from kiln.models.gemm_epilogues import fp8_gemm_add_rms_norm_quant_triton

        return fp8_gemm_add_rms_norm_quant_triton(q, weight, x_scale, weight_scale, residual, norm_weight, eps)
    y = torch.ops.kiln.fp8_gemm(q, weight, x_scale, weight_scale, torch.bfloat16).to(residual.dtype)
    normed, summed = _add_rms_norm(y, residual, norm_weight, eps)
    return (*quantize_per_token(normed), summed)


@fp8_gemm_add_rms_norm_quant.register_fake
def _fp8_gemm_add_rms_norm_quant_fake(q, weight, x_scale, weight_scale, residual, norm_weight, eps):
    from kiln.models.quant.fp8 import FP8_DTYPE

    m, n = q.shape[0], weight.shape[0]
    return (q.new_empty((m, n), dtype=FP8_DTYPE), q.new_empty((m, 1), dtype=torch.float32),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


# -- the qkv GEMM with RoPE in its epilogue (16-bit weights, no q/k norm) --------------------------------------
@torch.library.custom_op("kiln::qkv_rope", mutates_args=())
def qkv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K], weight [(H + 2 Hkv) D, K] -> (q [T, H, D], k [T, Hkv, D] rotated by RoPE, v [T, Hkv, D]), each
    contiguous. Dispatched on T as kiln::dense_gemm is: its small-M kernel rotates in the epilogue; larger T (and
    the CPU) run the GEMM, then the unfused graph's rotation (kiln's RoPE kernel on CUDA)."""
    from kiln.models import dense_gemm

    if x.is_cuda and x.shape[0] <= dense_gemm.TRITON_MAX_M:
        from kiln.models.gemm_epilogues import qkv_rope_triton

        return qkv_rope_triton(x, weight, positions, cos_sin_cache, num_heads, num_kv_heads)
    head_dim = cos_sin_cache.shape[-1]
    q, k, v = torch.mm(x, weight.t()).split([num_heads * head_dim, num_kv_heads * head_dim,
                                             num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(x.shape[0], -1, head_dim) for t in (q, k, v))
    positions = positions[: x.shape[0]]
    v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # fresh, as the fake says
    if _use_triton(x):  # one kernel rotates q and k and copies v, as Inductor's for the unfused graph does
        from kiln.passes.kernels import norm_rope_triton

        q, k = norm_rope_triton(q, k, positions, cos_sin_cache, None, None, 0.0, v=v, v_out=v_out)
        return q, k, v_out
    q, k = norm_rope_ref(q, k, positions, cos_sin_cache, None, None, 0.0)
    return q.contiguous(), k.contiguous(), v_out.copy_(v)


@qkv_rope.register_fake
def _qkv_rope_fake(x, weight, positions, cos_sin_cache, num_heads, num_kv_heads):
    head_dim = cos_sin_cache.shape[-1]
    return (x.new_empty((x.shape[0], num_heads, head_dim)), x.new_empty((x.shape[0], num_kv_heads, head_dim)),
            x.new_empty((x.shape[0], num_kv_heads, head_dim)))


# -- SiLU-and-mul + FP8 per-token quantization ---------------------------------------------------------------
def silu_mul_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused graph's arithmetic: SiLU in fp32 rounded to x's dtype, times up (rounded), then
    kiln/models/quant/fp8.py's per-token quantization."""
    from kiln.models.quant.fp8 import quantize_per_token

    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    return quantize_per_token((g / (1 + torch.exp(-g))).to(x.dtype) * up)


@torch.library.custom_op("kiln::silu_mul_quant", mutates_args=())
def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2N] = [gate | up] -> the per-token FP8 quantization of silu(gate) * up: (e4m3 [T, N], fp32 [T, 1])."""
    if _use_triton(x):
        from kiln.passes.kernels import silu_mul_quant_triton

        return silu_mul_quant_triton(x)
    return silu_mul_quant_ref(x)


@silu_mul_quant.register_fake
def _silu_mul_quant_fake(x):
    return (x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


# -- tensor-parallel all-reduce + residual add + RMSNorm ----------------------------------------------------
@torch.library.custom_op("kiln::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(all_reduce(x) + residual), all_reduce(x) + residual). The sum is rounded to x's dtype
    before the add, as the unfused graph's all-reduce output is. On a P2P group at decode sizes all of it is
    one kernel (kiln/models/p2p_norm.py); otherwise the all-reduce, then the add + norm."""
    from kiln.models.allreduce import all_reduce_impl, communicator

    comm = communicator(group_name) if x.is_cuda else None
    fused = comm.add_rms_norm(x, residual, weight, eps) if comm is not None else None
    if fused is not None:
        return fused
    return _add_rms_norm(all_reduce_impl(x, group_name), residual, weight, eps)


@all_reduce_add_rms_norm.register_fake
def _all_reduce_add_rms_norm_fake(x, residual, weight, eps, group_name):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))
