"""One kernel for the tensor-parallel all-reduce + residual add + RMSNorm at decode sizes (Triton, CUDA).

At batch 1-32 a row-parallel projection's all-reduce is a few KB per rank; torch's one-shot kernel then
Inductor's (or kiln's) add + norm are two launches and two dependent round trips through memory, ~11 us
together on 2 H200s, 2 x layers times a step. Here one program per token row: copy the row into this
rank's symmetric buffer, meet every rank at a barrier, sum every rank's row (in rank order, so all ranks
hold the same bits), add the residual, normalise, and store both. No second barrier guards the buffer row
against the next call's write: a row's calls alternate between two halves of the kernel's own region of the
buffer, counted per row on the device, and a peer can be at most one call ahead of this rank (it cannot pass
the next call's barrier before this rank arrives there), so it never writes the half this rank still reads.

The barrier is the usual flag protocol over the symmetric signal pads (a peer's flag is set with a
compare-and-swap 0 -> 1 and consumed with 1 -> 0, release / acquire at system scope), which is also the one
torch's symmetric-memory kernels use; this kernel takes its flags from the upper half of the pad, so the two
never share a slot. Only threads 0..world-1 of a program touch flags (thread i pairs with rank i); the
CTA barriers around them order every thread's buffer stores and loads with the flags.

Casts follow the unfused graph: the sum is rounded to the model dtype (the all-reduce's output), the
residual add rounds again, and the norm's `x.to(dtype)` and `weight * x` round as RMSNorm does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _thread_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


def _cas_loop(sem: str, expect: int, new: int) -> tl.constexpr:
    """PTX: retry a system-scope compare-and-swap of the flag at $1 from `expect` to `new` until it succeeds."""
    return tl.constexpr(f"""
        {{
            .reg .u32 %old;
            .reg .pred %retry;
            cas_{sem}:
            atom.global.{sem}.sys.cas.b32 %old, [$1], {expect}, {new};
            setp.ne.u32 %retry, %old, {expect};
            @%retry bra cas_{sem};
            mov.u32 $0, %old;
        }}
        """)


# wait until the flag is free, then set it, releasing this CTA's earlier stores system-wide
_SET_FLAG = _cas_loop("release", 0, 1)
# wait until the flag is set, then clear it, acquiring what its setter released
_TAKE_FLAG = _cas_loop("acquire", 1, 0)


@triton.jit
def _flag_op(addr, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(pad_ptrs, rank, slot, WORLD: tl.constexpr):
    """Every rank's program using flags [slot, slot + WORLD) has reached this point."""
    tl.debug_barrier()
    tid = _thread_id()
    if tid < WORLD:  # thread i signals rank i and waits for rank i's signal
        peer_pad = tl.load(pad_ptrs + tid).to(tl.pointer_type(tl.int32))
        own_pad = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
        _flag_op(peer_pad + slot + rank, _SET_FLAG)
        _flag_op(own_pad + slot + tid, _TAKE_FLAG)
    tl.debug_barrier()


@triton.jit
def _buffer(buffer_ptrs, rank, dtype: tl.constexpr):
    """Rank `rank`'s symmetric buffer; 16-byte aligned (an allocation), which Triton cannot know of a pointer
    read from memory and needs to vectorise the loads and stores."""
    return tl.multiple_of(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _p2p_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, epoch_ptr, buffer_ptrs, signal_pad_ptrs, rank,
                             first_slot, region, half, s_x, s_r, n, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = x_ptr.dtype.element_ty
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
    slot = first_slot + row * WORLD
    local = tl.multiple_of(row.to(tl.int64) * n, 16) + offs  # rows of n elements, n a multiple of 16 (caller)
    # this row's calls alternate between the region's two halves: a peer writes half h again only two calls
    # later, after the barrier of the call between, which this rank reaches only once it has read half h
    epoch = tl.load(epoch_ptr + row)
    at = region + (epoch & 1).to(tl.int64) * half + local  # the low bit alternates through the int32 wrap too
    x = tl.load(x_ptr + row.to(tl.int64) * s_x + offs, mask=mask)
    # the residual and the norm's weight now, not after the barrier and the sum (a round trip of their own there)
    r = tl.load(r_ptr + row.to(tl.int64) * s_r + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(_buffer(buffers, rank, dtype) + at, x, mask=mask)
    _barrier(pads, rank, slot, WORLD)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # rank order on every rank: the same sum everywhere
        acc += tl.load(_buffer(buffers, peer, dtype) + at, mask=mask, other=0.0, volatile=True).to(tl.float32)
    tl.store(epoch_ptr + row, epoch + 1)
    summed = (acc.to(dtype).to(tl.float32) + r).to(dtype)
    tl.store(sum_ptr + local, summed, mask=mask)
    sf = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / n + eps)
    tl.store(out_ptr + local, (w * (sf * inv).to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def p2p_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle,
                     epochs: torch.Tensor, first_slot: int, region_bytes: int,
                     half_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (this rank's partial sum), residual [T, N] -> (rms_norm(sum + residual), sum + residual).

    `epochs` [>= T] int32 counts each row's calls (the same on every rank: they make the same calls); the
    buffer's bytes [region_bytes, region_bytes + 2 * half_bytes) are this kernel's alone. The caller checked
    that T rows of N (a multiple of 16) fit a half and the flag range."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out, summed
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    block = triton.next_power_of_2(n)
    _p2p_add_rms_norm_kernel[(rows,)](
        x, residual, weight, out, summed, epochs, handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, handle.rank,
        first_slot, region_bytes // x.element_size(), half_bytes // x.element_size(), x.stride(0),
        residual.stride(0), n, eps, WORLD=handle.world_size, BLOCK=block, num_warps=min(16, max(4, block // 256)))
    return out, summed
