"""The Triton kernel of `kiln::moe_route` (routing.py): one program per token takes the router GEMM's logits
(16-bit, as the GEMM leaves them) and picks the top k with their weights, its E logits in registers.

Folding the router GEMM into it as well (programs per (token, 16 experts), the last of a token's to finish
picking its top k) was measured and dropped: 11.5-13.2 us a layer at 1-64 tokens against 6.5-7.5 us for the
cuBLAS GEMM then this kernel, Qwen3-30B-A3B's router, inside CUDA graphs (H200, 2026-12-02, docs/moe.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start


@triton.jit
def _moe_topk_kernel(logits_ptr, weights_ptr, ids_ptr, NUM_E, s_lt, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                     E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    logits = tl.load(logits_ptr + token * s_lt + offs, mask=offs < NUM_E, other=float("-inf")).to(tl.float32)
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
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    e_pow2 = triton.next_power_of_2(num_experts)
    _moe_topk_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOPK=top_k,
                                    K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2,
                                    RENORMALIZE=renormalize, num_warps=4 if e_pow2 >= 256 else 1,
                                    **pdl_launch(logits.device))
    return weights, ids
