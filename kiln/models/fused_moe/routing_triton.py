"""The Triton kernels of `kiln::moe_route` (routing.py).

- `_moe_topk_kernel`: one program per token takes the router GEMM's logits (16-bit, as the GEMM leaves them) and
  picks the top k with their weights, its E logits in registers.
- `_moe_route_kernel` (KILN_MOE_ROUTER=fused, up to FUSED_MAX_TOKENS tokens): the router GEMM too. Program
  (token, block of BLOCK_E experts) computes its experts' logits from the hidden state, so a token's E x H router
  weight is read by E / BLOCK_E programs at once instead of one GEMM launch and a top-k launch after it; the last
  of a token's programs to finish (an atomic ticket, as the decode attention's split merge) picks the top k and
  resets the ticket for the next layer, step or graph replay.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# KILN_MOE_ROUTER: "gemm" (the router GEMM, then the top-k kernel) or "fused" (one kernel up to FUSED_MAX_TOKENS
# tokens); an A/B switch until the H200 says which (benchmarks/gpu/run.sh moe-router)
ROUTER = os.environ.get("KILN_MOE_ROUTER", "gemm")
if ROUTER not in ("gemm", "fused"):
    raise ValueError(f"KILN_MOE_ROUTER={ROUTER!r}: expected 'gemm' or 'fused'")
FUSED_MAX_TOKENS = 64
_BLOCK_E = 16
_BLOCK_K = 128
_tickets: dict[torch.device, torch.Tensor] = {}  # per device, FUSED_MAX_TOKENS zeros; each launch leaves them zero


@triton.jit
def _write_top_k(logits, offs, weights_ptr, ids_ptr, token, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                 E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The top k of one token's logits [E_POW2] (-inf past the experts) and their weights, stored at its rows."""
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


@triton.jit
def _moe_topk_kernel(logits_ptr, weights_ptr, ids_ptr, NUM_E, s_lt, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                     E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    logits = tl.load(logits_ptr + token * s_lt + offs, mask=offs < NUM_E, other=float("-inf")).to(tl.float32)
    _write_top_k(logits, offs, weights_ptr, ids_ptr, token, TOPK, K_POW2, E_POW2, RENORMALIZE)


@triton.jit
def _moe_route_kernel(x_ptr, w_ptr, logits_ptr, ticket_ptr, weights_ptr, ids_ptr, NUM_E, H, s_xt, s_we,
                      TOPK: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < NUM_E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_E,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = k0 + offs_k < H
        x = tl.load(x_ptr + token * s_xt + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * s_we + k0 + offs_k[None, :],
                    mask=e_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    # rounded to the activations' dtype, as the router GEMM's output is
    tl.store(logits_ptr + token * NUM_E + offs_e, acc.to(x_ptr.dtype.element_ty).to(tl.float32), mask=e_mask)
    tl.debug_barrier()  # every thread's logits are stored before the (release) ticket
    if tl.atomic_add(ticket_ptr + token, 1) == tl.num_programs(1) - 1:  # acq_rel: the others' logits are visible
        offs = tl.arange(0, E_POW2)
        logits = tl.load(logits_ptr + token * NUM_E + offs, mask=offs < NUM_E, other=float("-inf"),
                         cache_modifier=".cg")
        _write_top_k(logits, offs, weights_ptr, ids_ptr, token, TOPK, K_POW2, E_POW2, RENORMALIZE)
        tl.store(ticket_ptr + token, 0)


def _outputs(num_tokens: int, top_k: int, num_experts: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weights, ids) outputs, once top_k is checked against the experts."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    return (torch.empty((num_tokens, top_k), dtype=torch.float32, device=device),
            torch.empty((num_tokens, top_k), dtype=torch.int32, device=device))


def moe_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    weights, ids = _outputs(num_tokens, top_k, num_experts, logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    e_pow2 = triton.next_power_of_2(num_experts)
    _moe_topk_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOPK=top_k,
                                    K_POW2=triton.next_power_of_2(top_k), E_POW2=e_pow2,
                                    RENORMALIZE=renormalize, num_warps=4 if e_pow2 >= 256 else 1)
    return weights, ids


def _tickets_for(device: torch.device) -> torch.Tensor | None:
    """The persistent tickets, made outside any CUDA-graph capture (a graph keeps their address); None if this
    first call is being captured."""
    tickets = _tickets.get(device)
    if tickets is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        tickets = _tickets[device] = torch.zeros(FUSED_MAX_TOKENS, dtype=torch.int32, device=device)
    return tickets


def moe_route_triton(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                     fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [E, H] -> (weights fp32 [T, K], ids int32 [T, K]); `fused` overrides ROUTER."""
    num_tokens = x.shape[0]
    num_experts = gate_weight.shape[0]
    fused = ROUTER == "fused" if fused is None else fused
    tickets = _tickets_for(x.device) if fused and 0 < num_tokens <= FUSED_MAX_TOKENS else None
    if tickets is None:
        return moe_topk_triton(F.linear(x, gate_weight), top_k, renormalize)
    weights, ids = _outputs(num_tokens, top_k, num_experts, x.device)
    x = x.contiguous()
    gate_weight = gate_weight.contiguous()
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=x.device)
    _moe_route_kernel[(num_tokens, triton.cdiv(num_experts, _BLOCK_E))](
        x, gate_weight, logits, tickets, weights, ids, num_experts, x.shape[1], x.stride(0), gate_weight.stride(0),
        TOPK=top_k, K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(num_experts),
        BLOCK_E=_BLOCK_E, BLOCK_K=_BLOCK_K, RENORMALIZE=renormalize, num_warps=4)
    return weights, ids
