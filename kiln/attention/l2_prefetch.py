"""Asking L2 for the o projection's weight while a small decode step's attention runs.

Why: at a few requests a layer's decode attention reads a few hundred KB of KV and its kernels (decode, merge)
take microseconds of latency in which HBM sits idle, while the o projection right after them streams its whole
weight from HBM (Qwen3-30B-A3B's 17 MB: 7.6 us against 5.6 at the copy rate on an H100). A one-warp kernel launched
just before the decode kernel waits for the qkv GEMM (PDL), then asks L2 for that weight with Hopper's bulk
prefetch (nothing lands in registers) and exits: the decode kernel starts as before, and the o projection reads
what HBM delivered meanwhile from L2. Not before the wait: the qkv GEMM is still streaming then, and the bytes would
only move from one kernel's time to another's.

On with PDL (its point is the overlap) at most KILN_L2_PREFETCH_MAX_REQS requests (0: off).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

MAX_REQS = int(os.environ.get("KILN_L2_PREFETCH_MAX_REQS", "0"))
CHUNK_BYTES = 32 * 1024  # one bulk prefetch
CHUNKS_PER_PROGRAM = 32  # one a thread of a one-warp program


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, nbytes - CHUNK)  # past the end: the last chunk again (nbytes >= CHUNK, both % 16 == 0)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptr + offs, tl.full(offs.shape, CHUNK, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


def applies(weight: torch.Tensor, num_reqs: int) -> bool:
    """Whether a decode step of `num_reqs` requests asks L2 for `weight` (contiguous, 16-byte aligned, one chunk or
    more, on a GPU running kiln's kernels with PDL)."""
    return (0 < num_reqs <= MAX_REQS and weight.is_cuda and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and weight.numel() * weight.element_size() >= CHUNK_BYTES
            and pdl_launch(weight.device)["PDL"])


def prefetch(weight: torch.Tensor) -> None:
    """Launches the prefetch of `weight` (`applies` said yes) on the current stream."""
    nbytes = weight.numel() * weight.element_size() // 16 * 16
    grid = (triton.cdiv(nbytes, CHUNK_BYTES * CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](weight.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK_BYTES,
                              PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=1, **pdl_launch(weight.device))
