"""align_by_expert (align.py) as one Triton program, for up to MAX_PAIRS pairs (decode batches, short prefills).

The torch version is some thirty small kernels (count, pad, scan, sort, scatter, search); inside a CUDA graph each
costs a couple of microseconds however little it does, which summed over 48 layers was a fifth of a batch-64
decode step's floor. Here one program does all of it on one SM: a histogram of the expert ids, the padded
offsets by a scan, a sort of (expert, pair) keys for each pair's rank within its expert, then the scatter. The
layout is exactly the torch version's (tests/models/test_fused_moe.py compares them), so either may serve.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.fused_moe.align import max_padded_pairs
from kiln.models.pdl import pdl_launch, pdl_start

# one program's sort; larger steps (long prefills) take the torch version. 4096 covers every CUDA-graph size of
# the default capture list (up to 512 tokens) at top-8, so graphs hold only this kernel
MAX_PAIRS = 4096
_CHUNK = 128  # blocks (and sentinel rows) handled per loop step, bounding the registers a 2-D compare needs


@triton.jit(do_not_specialize=["num_pairs", "size", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, offset_ptr, num_pairs, size, num_blocks,
                  NUM_E: tl.constexpr, E_POW2: tl.constexpr, NMAX: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    offs = tl.arange(0, NMAX)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=NUM_E).to(tl.int32)
    ids = tl.minimum(ids, NUM_E)  # NUM_E: another rank's expert, or past the pairs
    counts = tl.histogram(ids, E_POW2)
    bins = tl.arange(0, E_POW2)
    real = bins < NUM_E
    padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, 0)
    # where an expert's pairs move: from its start in sorted order to its padded start
    tl.store(offset_ptr + bins, (padded_end - padded) - (tl.cumsum(counts, 0) - counts))
    chunk = tl.arange(0, CHUNK)
    for row in range(0, size, CHUNK):  # padding rows hold the pair count (invalid)
        tl.store(sorted_ptr + row + chunk, num_pairs, mask=row + chunk < size)
    for block in range(0, num_blocks, CHUNK):  # a block's expert: how many experts end at or before it
        first_row = (block + chunk) * BLOCK_M
        ended = (padded_end[None, :] <= first_row[:, None]) & real[None, :]
        tl.store(block_expert_ptr + block + chunk, tl.sum(ended.to(tl.int32), axis=1), mask=block + chunk < num_blocks)
    tl.debug_barrier()  # the offsets and the padding rows are written before any pair lands
    keys = tl.sort(ids * NMAX + offs)  # by expert, then by pair: the stable order
    expert = keys // NMAX
    here = expert < NUM_E
    dest = offs + tl.load(offset_ptr + expert, mask=here, other=0)
    tl.store(sorted_ptr + dest, keys % NMAX, mask=here)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract as align.align_by_expert, for topk_ids.numel() <= MAX_PAIRS."""
    n = topk_ids.numel()
    size = max_padded_pairs(n, num_experts, block_m)
    num_blocks = size // block_m
    device = topk_ids.device
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    e_pow2 = triton.next_power_of_2(num_experts + 1)
    offsets = torch.empty(e_pow2, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_pairs, block_expert, offsets, n, size, num_blocks,
                        NUM_E=num_experts, E_POW2=e_pow2, NMAX=max(16, triton.next_power_of_2(n)),
                        BLOCK_M=block_m, CHUNK=_CHUNK, num_warps=8 if n > 512 else 4, **pdl_launch(device))
    return sorted_pairs, block_expert
