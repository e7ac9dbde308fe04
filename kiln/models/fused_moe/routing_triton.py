"""The Triton kernel of `kiln::moe_route` (routing.py): one program per token takes the router GEMM's logits
(16-bit, as the GEMM leaves them) and picks the top k with their weights, its E logits in registers.

At decode sizes (kiln::dense_gemm's small-M kernel) the GEMM writes fp32 sums, split-K partials or one whole-K
partial, and the top-k program adds them in order and rounds them to the activation's dtype, as the GEMM's
split-K reduce does: the same logits (so the same routing, by test) without the reduce's launch, one kernel a MoE
layer fewer (Qwen3-30B-A3B's router splits K four ways at 1-16 tokens).

Folding the router GEMM into it as well (programs per (token, 16 experts), the last of a token's to finish
picking its top k) was measured and dropped: 11.5-13.2 us a layer at 1-64 tokens against 6.5-7.5 us for the
cuBLAS GEMM then this kernel, Qwen3-30B-A3B's router, inside CUDA graphs (H200, 2026-12-02, docs/moe.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _moe_topk_kernel(logits_ptr, weights_ptr, ids_ptr, NUM_E, s_lt, s_split, TOPK: tl.constexpr,
                     K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, SPLIT_K: tl.constexpr,
                     LOGIT_DTYPE: tl.constexpr, PDL: tl.constexpr = False):
    """SPLIT_K 0: logits_ptr holds the logits; else SPLIT_K fp32 partials s_split apart, summed in order and rounded
    to LOGIT_DTYPE (the GEMM's output dtype). The winners in order (slot 0 the largest, the lowest index among
    equals) by k passes of max-and-mask. (Picking them by rank, one [E, E] comparison and one sum, measured slower:
    docs/moe.md.)"""
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    valid = offs < NUM_E
    if SPLIT_K == 0:
        logits = tl.load(logits_ptr + token * s_lt + offs, mask=valid, other=float("-inf")).to(tl.float32)
    else:
        acc = tl.load(logits_ptr + token * s_lt + offs, mask=valid, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(logits_ptr + s * s_split + token * s_lt + offs, mask=valid, other=0.0)
        logits = tl.where(valid, acc.to(LOGIT_DTYPE).to(tl.float32), float("-inf"))
    slots = tl.arange(0, K_POW2)
    top = tl.full((K_POW2,), float("-inf"), tl.float32)
    ids = tl.zeros((K_POW2,), tl.int32)
    remaining = logits
    for slot in tl.static_range(TOPK):  # k passes: the largest left, the lowest index among equals
        best = tl.max(remaining, axis=0)
        index = tl.min(tl.where(remaining == best, offs, E_POW2), axis=0)
        top = tl.where(slots == slot, best, top)
        ids = tl.where(slots == slot, index, ids)
        remaining = tl.where(offs == index, float("-inf"), remaining)
    if RENORMALIZE:  # the softmax over the winners: the full softmax renormalised over them
        weights = tl.exp(top - tl.max(top, axis=0))
        weights = weights / tl.sum(weights, axis=0)
    else:  # the full softmax's values at the winners
        peak = tl.max(logits, axis=0)
        weights = tl.exp(top - peak) / tl.sum(tl.exp(logits - peak), axis=0)
    keep = slots < TOPK
    tl.store(weights_ptr + token * TOPK + slots, weights, mask=keep)
    tl.store(ids_ptr + token * TOPK + slots, ids, mask=keep)


def moe_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights fp32 [T, K], ids int32 [T, K])."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _top_k(logits, 0, logits.dtype, top_k, renormalize)


def moe_route_triton(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (T within the small-M kernel's reach), the router's weight [E, H] -> (weights fp32 [T, K], ids int32
    [T, K]): the GEMM's fp32 sums go straight to the top-k kernel. The GEMM runs kiln::dense_gemm's config for the
    shape, so the logits are the ones its output would hold."""
    from kiln.models.quant.fp8_kernel import check_operands, gemm_partials

    check_operands(x, gate_weight)
    return top_k_of_partials(gemm_partials(x, gate_weight), x.dtype, top_k, renormalize)


def top_k_of_partials(partials: torch.Tensor, logit_dtype: torch.dtype, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMM's fp32 partials [splits, T, E] (summed in order, rounded to `logit_dtype`) -> (weights,
    ids)."""
    return _top_k(partials, partials.shape[0], logit_dtype, top_k, renormalize)


def _top_k(source: torch.Tensor, splits: int, logit_dtype: torch.dtype, top_k: int,
           renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """source: logits [T, E] (splits 0) or fp32 partials [splits, T, E], both with unit last stride."""
    num_tokens, num_experts = source.shape[-2:]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=source.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=source.device)
    if num_tokens == 0:
        return weights, ids
    e_pow2 = triton.next_power_of_2(num_experts)
    _moe_topk_kernel[(num_tokens,)](source, weights, ids, num_experts, source.stride(-2),
                                    source.stride(0) if splits else 0, TOPK=top_k,
                                    K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2, RENORMALIZE=renormalize,
                                    SPLIT_K=splits, LOGIT_DTYPE=_TL_DTYPES[logit_dtype],
                                    num_warps=4 if e_pow2 >= 256 else 1, **pdl_launch(source.device))
    return weights, ids
