"""The split-row argmax kernel behind kiln/models/greedy_argmax.py (which says why): CHUNK-wide slices of a row, one
program each, and the row's last program to finish (an atomic ticket) compares the slices."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

CHUNK = 4096  # logits a program reads: ~32 programs for a 128K vocabulary (wider past SLICES of them)
SLICES = 64  # slices a row's last program compares: one compiled kernel for every vocabulary up to 256K
_NO_ID = 2**31 - 1

# per device, a zeroed int32 counter per row, reset by the row's last program: launches on one device must not run
# at once (kiln runs a step's kernels on one stream)
_tickets: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _best(values, ids, NO_ID: tl.constexpr):
    """(value, id) of the largest of `values`, the lowest id on ties; the first NaN's id (by id) if any."""
    is_nan = values != values
    first_nan = tl.min(tl.where(is_nan, ids, NO_ID), axis=0)
    value, at = tl.max(tl.where(is_nan, float("-inf"), values), axis=0, return_indices=True,
                       return_indices_tie_break_left=True)
    best = tl.min(tl.where(tl.arange(0, values.shape[0]) == at, ids, NO_ID), axis=0)
    has_nan = first_nan < NO_ID
    return tl.where(has_nan, float("nan"), value), tl.where(has_nan, first_nan, best)


@triton.jit(do_not_specialize=["vocab", "stride"])
def _row_max_kernel(x_ptr, part_val_ptr, part_id_ptr, ticket_ptr, val_ptr, id_ptr, vocab, stride,
                    CHUNK: tl.constexpr, SLICES: tl.constexpr, NO_ID: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    value, idx = _best(x, offs, NO_ID)
    part = row * chunks + chunk
    tl.store(part_val_ptr + part, value)
    tl.store(part_id_ptr + part, idx)
    # acq_rel: this program's partials are visible to the row's last program, which sees every other's
    if tl.atomic_add(ticket_ptr + row, 1) == chunks - 1:
        slots = tl.arange(0, SLICES)
        mask = slots < chunks
        values = tl.load(part_val_ptr + row * chunks + slots, mask=mask, other=float("-inf"), cache_modifier=".cg")
        ids = tl.load(part_id_ptr + row * chunks + slots, mask=mask, other=NO_ID, cache_modifier=".cg")
        value, idx = _best(values, ids, NO_ID)
        tl.store(val_ptr + row, value.to(val_ptr.dtype.element_ty))
        tl.store(id_ptr + row, idx.to(tl.int64))
        tl.store(ticket_ptr + row, 0)  # ready for the next launch


def _ticket_counters(rows: int, device: torch.device) -> torch.Tensor:
    tickets = _tickets.get(device)
    if tickets is None or tickets.numel() < rows:
        tickets = _tickets[device] = torch.zeros(triton.next_power_of_2(max(rows, 64)), dtype=torch.int32,
                                                 device=device)
    return tickets


def row_max_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab], each row contiguous -> (max value in the logits' dtype, int64 id) per row."""
    rows, vocab = logits.shape
    values = torch.empty(rows, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows and vocab:
        chunk = max(CHUNK, triton.next_power_of_2(triton.cdiv(vocab, SLICES)))
        chunks = triton.cdiv(vocab, chunk)
        part_val = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
        _row_max_kernel[(rows, chunks)](
            logits, part_val, part_id, _ticket_counters(rows, logits.device), values, ids, vocab, logits.stride(0),
            CHUNK=chunk, SLICES=SLICES, NO_ID=_NO_ID, num_warps=4,
            **pdl_launch(logits.device))
    return values, ids
