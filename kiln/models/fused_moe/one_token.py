"""`kiln::fused_moe` for a single token as one kernel: gate/up, SiLU-mul and down without a kernel boundary.

Why: at batch 1 a MoE layer's experts were two dependent kernels (docs/moe.md): gate/up 15.3 us against an 11.9 us
bytes floor and down 10.4 against 6.0 on Qwen3-30B-A3B's layer (one H200, 2026-12-04). Each pays the ramp of a
dependent launch (its wait, then the first DRAM round trip) on top of its bytes, and the down kernel's 25 MB are
too few to hide it. Here one program takes (pair, slice of the expert's intermediate dim): it computes that
slice of h = silu(x W_gate^T) * (x W_up^T) in registers, rounded as the stored h would be, and multiplies it by the
matching columns of W_down, a partial output row in fp32. Every weight byte is read once, by one kernel.

The slices of a pair are summed by the last of its programs to finish (an arrival counter per pair, rearmed by
that program for the next call, CUDA graph replays included), in slice order: the same bits every run, unlike
atomic adds. That program applies the down scale and routing weight and writes the pair's row, so the op's
contract ([T, K, H], summed over K by the caller) is unchanged. Weights may be e4m3 with one fp32 scale per
(expert, output channel), as in kernels.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kiln.models.pdl import pdl_launch, pdl_start

MAX_PAIRS = 64  # arrival counters kept per device: a token's top-k pairs


@dataclass(frozen=True)
class OneTokenConfig:
    block_i: int = 32  # intermediate columns a program owns (the slice; >= 16, tl.dot's least K)
    block_k: int = 128  # hidden columns a gate/up step reads
    block_h: int = 128  # output rows a down step writes
    num_warps: int = 4
    num_stages: int = 3


@cache
def one_token_config() -> OneTokenConfig | None:
    """The one-kernel path's config, or None (the two-kernel path): `KILN_MOE_ONE_TOKEN=1` takes the defaults,
    `=BLOCK_I,BLOCK_K,BLOCK_H,WARPS,STAGES` a tile for an A/B; unset or 0: off until the H200 has measured it."""
    raw = os.environ.get("KILN_MOE_ONE_TOKEN", "0")
    if raw in ("", "0"):
        return None
    if raw == "1":
        return OneTokenConfig()
    return OneTokenConfig(*(int(v) for v in raw.split(",")))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """Zeros between calls; allocated on a device's first call (the eager warm-up, before any capture)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_PAIRS, dtype=torch.int32, device=device)
    return counters


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (this package's kernels' one product)."""
    if IEEE:  # fp32 models: no TF32 rounding
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _one_token_moe_kernel(x_ptr, w13_ptr, w2_ptr, ws13_ptr, ws2_ptr, tw_ptr, ids_ptr, part_ptr, count_ptr, y_ptr,
                          H, INTER, NUM_E, s_we13, s_wn13, s_we2, s_wn2, SLICES: tl.constexpr,
                          BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                          SCALED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pair = tl.program_id(0)
    piece = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    local = expert < NUM_E  # else another rank's expert: the pair's row is zeros
    part_row = part_ptr + (pair * SLICES + piece).to(tl.int64) * H
    if local:  # the token is row 0 of a 16-row tile (tl.dot's least; the rest are zeros): MMAs keep the weight
        # loads asynchronous and pipelined, which a matrix-vector product in registers did not (the pair kernels)
        rows = tl.arange(0, 16)[:, None]
        offs_i = piece * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = offs_i < INTER
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = w13_ptr + expert * s_we13 + offs_i[None, :].to(tl.int64) * s_wn13 + offs_k[:, None]
        u_ptrs = g_ptrs + INTER * s_wn13
        acc_g = tl.zeros((16, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((16, BLOCK_I), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = k0 + offs_k < H
            a = tl.load(x_ptr + rows * 0 + k0 + offs_k[None, :], mask=(rows == 0) & k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None] & i_mask[None, :], other=0.0).to(a.dtype)
            u = tl.load(u_ptrs, mask=k_mask[:, None] & i_mask[None, :], other=0.0).to(a.dtype)
            acc_g = mma(a, g, acc_g, IEEE)
            acc_u = mma(a, u, acc_u, IEEE)
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if SCALED:
            acc_g *= tl.load(ws13_ptr + expert * 2 * INTER + offs_i, mask=i_mask, other=0.0)[None, :]
            acc_u *= tl.load(ws13_ptr + expert * 2 * INTER + INTER + offs_i, mask=i_mask, other=0.0)[None, :]
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h = tl.where(i_mask[None, :], h, 0.0).to(x_ptr.dtype.element_ty)  # rounded as the stored h is
        offs_n = tl.arange(0, BLOCK_H)
        d_ptrs = w2_ptr + expert * s_we2 + offs_n[None, :].to(tl.int64) * s_wn2 + offs_i[:, None]
        for n0 in range(0, H, BLOCK_H):
            n_mask = n0 + offs_n < H
            w = tl.load(d_ptrs, mask=i_mask[:, None] & n_mask[None, :], other=0.0).to(h.dtype)
            partial = mma(h, w, tl.zeros((16, BLOCK_H), dtype=tl.float32), IEEE)
            tl.store(part_row + rows * 0 + n0 + offs_n[None, :], partial, mask=(rows == 0) & n_mask[None, :])
            d_ptrs += BLOCK_H * s_wn2
    tl.debug_barrier()  # every warp's partial is stored before this program's arrival is counted
    arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
    if arrived == SLICES - 1:  # the pair's last program: sum its slices in order, write its row, rearm
        offs_n = tl.arange(0, BLOCK_H)
        weight = tl.load(tw_ptr + pair)
        first = part_ptr + (pair * SLICES).to(tl.int64) * H
        for n0 in range(0, H, BLOCK_H):
            n_mask = n0 + offs_n < H
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            if local:
                for s in range(SLICES):
                    acc += tl.load(first + s * H + n0 + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
                if SCALED:
                    acc *= tl.load(ws2_ptr + expert * H + n0 + offs_n, mask=n_mask, other=0.0)
                acc *= weight
            tl.store(y_ptr + pair.to(tl.int64) * H + n0 + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
        tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")


def fused_moe_one_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                        config: OneTokenConfig) -> torch.Tensor:
    """x [1, H] -> each pair's weighted row [1, K, H]: kernels.py's contract (e4m3 weights with their scales)."""
    hidden = x.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if x.shape[0] != 1 or top_k > MAX_PAIRS:
        raise ValueError(f"one token of at most {MAX_PAIRS} pairs, got ids of shape {tuple(topk_ids.shape)}")
    if min(config.block_i, config.block_k, config.block_h) < 16:
        raise ValueError(f"{config}: every block must be at least 16 (tl.dot's least)")
    slices = triton.cdiv(inter, config.block_i)
    tw = topk_weights.float().contiguous()
    scaled = w13_scale is not None
    ws13, ws2 = (w13_scale.float().contiguous(), w2_scale.float().contiguous()) if scaled else (tw, tw)
    partials = torch.empty((top_k * slices, hidden), dtype=torch.float32, device=x.device)
    y = torch.empty((top_k, hidden), dtype=x.dtype, device=x.device)
    _one_token_moe_kernel[(top_k, slices)](
        x.contiguous(), w13, w2, ws13, ws2, tw, topk_ids.contiguous(), partials,
        arrival_counters(x.device), y, hidden, inter, num_experts, w13.stride(0), w13.stride(1), w2.stride(0),
        w2.stride(1), SLICES=slices, BLOCK_I=config.block_i, BLOCK_K=config.block_k, BLOCK_H=config.block_h,
        SCALED=scaled, IEEE=x.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch(x.device))
    return y.view(1, top_k, hidden)
