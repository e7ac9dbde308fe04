"""The Triton kernel that unpacks a step's staged inputs (input_upload.py) into the runner's device arrays."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start
from kiln.runtime.input_upload import HEADER, ORDER, Counts, device_dtype

BLOCK = 1024


# the counts change every step: not specialized, one compile serves them all
@triton.jit(do_not_specialize=["tokens", "reqs", "logit_rows", "width", "s_bt", "total"])
def _unpack_kernel(src_ptr, ids_ptr, pos_ptr, slot_ptr, qsl_ptr, seq_ptr, logit_ptr, bt_ptr, sampled_ptr, tokens,
                   reqs, logit_rows, width, s_bt, total, PENDING: tl.constexpr, BLOCK: tl.constexpr,
                   HEADER: tl.constexpr, FROM_HEADER: tl.constexpr, PDL: tl.constexpr = False):
    """Program i: staged ints [i * BLOCK, (i + 1) * BLOCK) after the header, each written to the array its offset
    falls in. FROM_HEADER: the counts and the samples' address are the header's, not the arguments'."""
    pdl_start(PDL)
    if FROM_HEADER:
        tokens = tl.load(src_ptr)
        reqs = tl.load(src_ptr + 1)
        logit_rows = tl.load(src_ptr + 2)
        width = tl.maximum(tl.load(src_ptr + 3), 1)
        total = tl.load(src_ptr + 4)
        address = (tl.load(src_ptr + 5).to(tl.int64) & 0xFFFFFFFF) | (tl.load(src_ptr + 6).to(tl.int64) << 32)
        sampled_ptr = address.to(tl.pointer_type(tl.int64))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    v = tl.load(src_ptr + HEADER + offs, mask=live, other=0)
    end_ids = tokens
    end_pos = end_ids + tokens
    end_slot = end_pos + tokens
    end_qsl = end_slot + reqs + 1
    end_seq = end_qsl + reqs
    end_logit = end_seq + logit_rows
    ids = v.to(tl.int64)
    in_ids = live & (offs < end_ids)
    if PENDING or FROM_HEADER:  # -1 - row: the token the step in flight samples into that row
        pending = in_ids & (v < 0)
        ids = tl.where(pending, tl.load(sampled_ptr + (-1 - v), mask=pending, other=0), ids)
    tl.store(ids_ptr + offs, ids, mask=in_ids)
    tl.store(pos_ptr + (offs - end_ids), v.to(tl.int64), mask=live & (offs >= end_ids) & (offs < end_pos))
    tl.store(slot_ptr + (offs - end_pos), v.to(tl.int64), mask=live & (offs >= end_pos) & (offs < end_slot))
    tl.store(qsl_ptr + (offs - end_slot), v, mask=live & (offs >= end_slot) & (offs < end_qsl))
    tl.store(seq_ptr + (offs - end_qsl), v, mask=live & (offs >= end_qsl) & (offs < end_seq))
    tl.store(logit_ptr + (offs - end_seq), v.to(tl.int64), mask=live & (offs >= end_seq) & (offs < end_logit))
    cell = tl.maximum(offs - end_logit, 0)
    tl.store(bt_ptr + (cell // width).to(tl.int64) * s_bt + cell % width, v, mask=live & (offs >= end_logit))


def unpack_triton(staged: torch.Tensor, dst: dict[str, torch.Tensor], counts: Counts,
                  sampled: torch.Tensor | None) -> None:
    """`unpack_reference`'s writes in one launch: int64 ids, positions, slots and logits indices, int32
    query_start_loc, seq_lens and block tables (K-contiguous rows)."""
    if counts.total:
        _launch(staged, dst, counts.total, counts, sampled, from_header=False)


def unpack_from_header(staged: torch.Tensor, dst: dict[str, torch.Tensor], max_ints: int) -> None:
    """The same writes with the counts and the samples (int64) the header names: a launch whose arguments do not
    change from step to step, for a CUDA graph to capture; `max_ints` bounds the packed ints of any step it serves."""
    _launch(staged, dst, max_ints, Counts(0, 0, 0, 1), None, from_header=True)


def _launch(staged: torch.Tensor, dst: dict[str, torch.Tensor], programs_cover: int, counts: Counts,
            sampled: torch.Tensor | None, from_header: bool) -> None:
    for name in (*ORDER, "block_tables"):
        if dst[name].dtype != device_dtype(name):
            raise ValueError(f"{name}: {dst[name].dtype}, the kernel writes {device_dtype(name)}")
    tables = dst["block_tables"]
    _unpack_kernel[(triton.cdiv(programs_cover, BLOCK),)](
        staged, dst["input_ids"], dst["positions"], dst["slot_mapping"], dst["query_start_loc"], dst["seq_lens"],
        dst["logits_indices"], tables, sampled if sampled is not None else dst["input_ids"], counts.tokens,
        counts.reqs, counts.logits, max(counts.width, 1), tables.stride(0), counts.total, PENDING=sampled is not None,
        BLOCK=BLOCK, HEADER=HEADER, FROM_HEADER=from_header, num_warps=4, **pdl_launch(staged.device))
