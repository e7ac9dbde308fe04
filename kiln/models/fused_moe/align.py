"""Tokens sorted and padded per expert, for the grouped GEMM kernels: plain torch, static shapes, no host sync.

The (token, k) pairs of a step are numbered p = t * top_k + k. `align_by_expert` lays them out expert by expert,
each expert's run padded to a multiple of BLOCK_M, so that every BLOCK_M-row block of the layout belongs to one
expert. Its sizes depend on the token count alone (CUDA graphs replay fixed sizes): at most min(E, pairs)
experts are non-empty and each adds at most BLOCK_M - 1 padding rows, so pairs + min(E, pairs) * (BLOCK_M - 1)
rows always suffice. Padding rows hold the pair count (an invalid pair, masked by the kernels); blocks past the
used ones, and pairs routed to an expert >= E (on another rank), belong to no expert (id E).
"""

from __future__ import annotations

import torch


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    blocks = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    return blocks * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (values in [0, E]; E: not here) -> (sorted_pairs [blocks * BLOCK_M] int32,
    block_expert [blocks] int32: the expert of each block, E for blocks that hold no pairs)."""
    flat = topk_ids.reshape(-1).long().clamp(max=num_experts)
    n = flat.numel()
    size = max_padded_pairs(n, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # pairs by expert, in pair order within an expert
    expert_of = flat[order]
    rank_in_expert = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    # pairs of expert E go to one extra slot past the end, dropped below
    start = torch.cat([padded_start, padded_start.new_full((1,), size)])
    dest = torch.where(expert_of < num_experts, start[expert_of] + rank_in_expert, size)
    sorted_pairs = torch.full((size + 1,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_first_row = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_first_row, right=True).to(torch.int32)
    return sorted_pairs[:size], block_expert
