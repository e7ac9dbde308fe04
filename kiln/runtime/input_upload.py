"""A step's inputs reach the device in one copy: packed on the host, unpacked on the device by one kernel.

A step's forward reads seven device arrays at fixed addresses (CUDA graphs replay them): input_ids, positions,
slot_mapping, query_start_loc, seq_lens, logits_indices and the block tables. Uploading each from its own pinned
buffer, unpacking the block tables and putting the step in flight's sampled tokens into input_ids (async
scheduling) took twelve stream operations before each graph launch: nine host-to-device copies, a device copy, an
index_select and an index_copy, each a launch on the host and, on the GPU, a microsecond or two plus the gap to the
next (none of them takes part in programmatic dependent launch). Here the used part of each host array is packed
into one pinned int32 buffer, copied in one transfer, and one kernel writes every array from it, reading a pending
token from the previous step's samples where the packed id says so (-1 - its row there; real ids are >= 0).

int32 holds every value: token ids, positions and request counts are far below 2^31, and so are slots (the KV
cache's blocks times the block size). On CUDA the unpacking is a Triton kernel; elsewhere `unpack_reference`, the
same writes in torch, which is also the kernel's test oracle.

The packed arrays follow a header of HEADER ints: the counts and the address of the previous step's samples, so
that a kernel launched without them (captured in a FULL CUDA graph, `KILN_UNPACK_IN_GRAPH=1`) reads them there and
the host launches no kernel of its own for a step that replays a graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

# the arrays in the order they are packed; all but the block tables are 1-D prefixes of their buffers
ORDER = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices")
INT32_ARRAYS = ("query_start_loc", "seq_lens", "block_tables")  # on the device; the others are int64
# tokens, requests, logits rows, block-table width, the packed ints after the header, the samples' address (low
# and high halves; 0: none), one unused
HEADER = 8
# Whether a FULL CUDA graph begins with the unpacking (reading the header), so a step that replays one launches no
# unpacking kernel from the host: SmolLM2-135M's host time a step 0.44-0.57 -> 0.19-0.25 ms on an H100
# (docs/runtime.md); KILN_UNPACK_IN_GRAPH=0 launches it from the host every step
IN_GRAPH = os.environ.get("KILN_UNPACK_IN_GRAPH", "1") == "1"


def device_dtype(name: str) -> torch.dtype:
    return torch.int32 if name in INT32_ARRAYS else torch.int64


@dataclass(frozen=True)
class Counts:
    """How much of each array a step uses: tokens (ids, positions, slots), requests (seq_lens; query_start_loc has
    one more), logits rows (logits_indices: the sampling rows, and prompt-logprob rows), and the block tables' rows x
    width."""

    tokens: int
    reqs: int
    logits: int
    width: int

    def lengths(self) -> tuple[int, ...]:
        return (self.tokens, self.tokens, self.tokens, self.reqs + 1, self.reqs, self.logits)

    @property
    def total(self) -> int:
        return sum(self.lengths()) + self.reqs * self.width


def staging_capacity(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """Ints the staging buffers need for the largest step, the header included."""
    return HEADER + 3 * max_tokens + 2 * max_seqs + 1 + max(max_seqs, max_tokens) + max_seqs * max_blocks


def pack(out: np.ndarray, host: dict[str, np.ndarray], counts: Counts, pending_dst: np.ndarray,
         pending_src: np.ndarray, samples_address: int = 0) -> int:
    """Write the header, then the used part of each host array into `out` (int32), input ids still pending as
    -1 - their row in the previous step's samples (an int64 tensor at `samples_address`); -> ints written."""
    low = samples_address & 0xFFFFFFFF
    out[:HEADER] = (counts.tokens, counts.reqs, counts.logits, counts.width, counts.total,
                    low - (1 << 32) if low >= 1 << 31 else low, samples_address >> 32, 0)
    out = out[HEADER:]
    at = 0
    for name, n in zip(ORDER, counts.lengths()):
        out[at:at + n] = host[name][:n]
        at += n
    out[pending_dst] = -1 - pending_src
    rows, width = counts.reqs, counts.width
    out[at:at + rows * width].reshape(rows, width)[:] = host["block_tables"][:rows, :width]
    return HEADER + at + rows * width


def unpack_reference(staged: torch.Tensor, dst: dict[str, torch.Tensor], counts: Counts,
                     sampled: torch.Tensor | None) -> None:
    """Write each array from the staged ints (after the header), in torch (any device)."""
    staged, at = staged[HEADER:], 0
    for name, n in zip(ORDER, counts.lengths()):
        part = staged[at:at + n].to(dst[name].dtype)
        if name == "input_ids" and sampled is not None:
            pending = part < 0
            part = torch.where(pending, sampled[(-1 - part).clamp_min(0)].to(part.dtype), part)
        dst[name][:n].copy_(part)
        at += n
    rows, width = counts.reqs, counts.width
    dst["block_tables"][:rows, :width].copy_(staged[at:at + rows * width].view(rows, width))


def unpack(staged: torch.Tensor, dst: dict[str, torch.Tensor], counts: Counts,
           sampled: torch.Tensor | None) -> None:
    """Write each array from the staged ints: one Triton kernel on CUDA (input_upload_triton.py)."""
    if staged.is_cuda:
        from kiln.runtime.input_upload_triton import unpack_triton

        unpack_triton(staged, dst, counts, sampled)
    else:
        unpack_reference(staged, dst, counts, sampled)
