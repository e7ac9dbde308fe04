"""Asking L2 for the o projection's weight while a small decode step's attention runs, from a side stream.

Why: at a few requests a layer's decode attention reads a few hundred KB of KV and its kernels (decode, merge)
take microseconds of latency in which HBM sits idle, while the o projection right after them streams its whole
weight from HBM (Qwen3-30B-A3B's 17 MB: 7.6 us on an H100, 6.1 once it sat in L2). A one-warp-a-program kernel asks
L2 for that weight with Hopper's bulk prefetch (nothing lands in registers). It runs on a side stream forked from
the step's stream once the qkv GEMM is done, so the chain of decode, merge and o kernels waits on nothing new: its
programs retire only once their prefetches have landed (in the step's own chain it held the decode kernel 4.9 us,
docs/attention.md). Each layer's attention joins the fork of the layer before it (long done by then), and the last
layer forks none, so a forward ends with the side stream joined (as a CUDA graph capture requires).

At most KILN_L2_PREFETCH_MAX_REQS requests (0: off).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_REQS = int(os.environ.get("KILN_L2_PREFETCH_MAX_REQS", "0"))
CHUNK_BYTES = 32 * 1024  # one bulk prefetch
CHUNKS_PER_PROGRAM = 32  # one a thread of a one-warp program


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, nbytes - CHUNK)  # past the end: the last chunk again (nbytes >= CHUNK, both % 16 == 0)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptr + offs, tl.full(offs.shape, CHUNK, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


def applies(weight: torch.Tensor, num_reqs: int) -> bool:
    """Whether a decode step of `num_reqs` requests asks L2 for `weight` (contiguous, 16-byte aligned, one chunk or
    more, on a Hopper-class GPU)."""
    return (0 < num_reqs <= MAX_REQS and weight.is_cuda and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and weight.numel() * weight.element_size() >= CHUNK_BYTES
            and torch.cuda.get_device_capability(weight.device)[0] >= 9)


class SideStream:
    """The side stream of one device and whether a fork of it is still to be joined."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # made before any graph capture
        self.forked = False

    def join(self) -> None:
        """The current stream waits for the last fork's prefetch (a no-op when nothing is forked)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False

    def prefetch(self, weight: torch.Tensor) -> None:
        """Forks from the current stream (after its work so far) and asks L2 for `weight` there."""
        self.join()
        self.stream.wait_stream(torch.cuda.current_stream())
        nbytes = weight.numel() * weight.element_size() // 16 * 16
        with torch.cuda.stream(self.stream):
            _l2_prefetch_kernel[(triton.cdiv(nbytes, CHUNK_BYTES * CHUNKS_PER_PROGRAM),)](
                weight.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK_BYTES, PER_PROGRAM=CHUNKS_PER_PROGRAM,
                num_warps=1)
        self.forked = True
