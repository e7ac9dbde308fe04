"""The greedy token of each row of logits: one Triton program per row on CUDA, `torch.argmax` elsewhere.

Why: ATen's argmax over one row of a vocabulary (49,152 bf16 logits, SmolLM2) took 13.7 us of a 0.71 ms batch-1
decode step on the H200 (2026-12-03 profile, `d7ecf0b`): its reduction walks the row with one block. A program
with every logit of a chunk loaded at once needs a few loads' latency for the row. Ties go to the lowest id, as in
torch; NaN counts as +inf (torch takes the first NaN, which differs only where a row also holds +inf before it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

CHUNK = 16384  # logits a program holds at once: 32 a thread at 16 warps
# KILN_ARGMAX_TRITON=0: torch.argmax on CUDA too (an A/B of the kernel's device time against its launch's host time)
USE_KERNEL = os.environ.get("KILN_ARGMAX_TRITON", "1") != "0"


@triton.jit(do_not_specialize=["vocab", "stride"])
def _argmax_kernel(x_ptr, out_ptr, vocab, stride, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = x_ptr + tl.program_id(0).to(tl.int64) * stride
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int32)
    for start in range(0, vocab, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        x = tl.load(row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        value, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        if value > best or start == 0:  # strictly: an earlier chunk keeps a tie
            best = value
            best_id = start + idx
    tl.store(out_ptr + tl.program_id(0), best_id.to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], each row contiguous -> int64 [rows] (any device Triton runs on, the interpreter too)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows and vocab:
        _argmax_kernel[(rows,)](logits, out, vocab, logits.stride(0), CHUNK=CHUNK, num_warps=16,
                                **pdl_launch(logits.device))
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> int64 [rows]: each row's argmax, the kernel on CUDA."""
    if USE_KERNEL and logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1]:
        return argmax_triton(logits)
    return logits.argmax(dim=-1)
