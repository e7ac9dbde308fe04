"""The Triton kernels of `kiln::fused_moe`, and their launcher.

Two shapes of the same two GEMMs (h = silu(x W_gate^T) * (x W_up^T), then y = h W_down^T weighted by the router):

- grouped (BLOCK_M >= 16): pairs sorted and padded per expert (align.py, align_triton.py; up to PAIR_BLOCK_TOKENS
  tokens one pair a block instead, and no align kernel runs); each program multiplies a BLOCK_M-row block of one
  expert's pairs by a BLOCK_N slice of that expert's weight with tl.dot.
  The gate and up slices are read by the same program, so SiLU-and-mul happens on the accumulators and only h is
  written. The down kernel scales each row by its routing weight and writes it to its pair's row.
- pairs (BLOCK_M == 1, decode): no sorting at all. One program per (pair, N slice) streams its expert's gate and up
  rows as a matrix-vector product on the CUDA cores, the way kiln/models/gemv_stream.py streams a dense projection;
  the down kernel's program per (token, N slice) streams the same rows of all the token's k experts at once and
  writes their weighted sum, so a token's rows never exist apart. A repeated expert is read once per pair that
  chose it, which is why this only pays while pairs are few (the tuned table says where; KILN_MOE_STREAM, below,
  for one token).

Both return each token's sum over its k pairs, [T, H]. The grouped down kernel writes each pair's weighted row and
a small kernel sums a token's (skipping pairs on another rank's experts, whose rows are never written, so nothing
is zero-filled); it takes the place of the kernel Inductor ran for that sum in the caller's graph, fused there with
the residual add, which may now join the next RMSNorm's kernel as it does in a dense layer.

Weights may be e4m3 with one fp32 scale per (expert, output channel): the tile is widened to the activation's
dtype before the product and the scale applied to the accumulator (exact: the scale is constant along K).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.models import gemv, gemv_stream
from kiln.models.fused_moe.align import align_by_expert
from kiln.models.fused_moe.align_triton import MAX_PAIRS, align_by_expert_triton
from kiln.models.fused_moe.configs import MoeKernelConfig, pick_config
from kiln.models.pdl import pdl_launch, pdl_start

# Steps of up to this many tokens run the grouped kernels on one pair a block: block j holds pair j in its first row,
# its expert read from the ids, so no align kernel runs and no program derives a layout (a repeated expert would be
# read once per pair, but a token's k experts are distinct). Inside CUDA graphs at Qwen3-30B-A3B's layer (one H200,
# 2026-12-03, `32c8378`, `bench_moe --parts layer`, one process), one token: 24.1 us against 28.4 with every
# program deriving the sorted layout from the ids in registers (the layout this replaced, `9541c57`) and 28.5
# through align; eight tokens: 116.6 against 116.0 and 114.7, so from two tokens on align's layout serves.
PAIR_BLOCK_TOKENS = 1
# A one-token step's experts run the pair kernels at the streaming matrix-vector rule (gemv_stream.pick_config over
# the step's pairs: a few rows a program, ~4 programs an SM, 4 KB of weight a K step) instead of the table's config:
# Qwen3-30B-A3B's experts at one token 33.3 -> 28.8 us a layer inside CUDA graphs (floor 25.1; e4m3 experts, no table
# entry, 22.1 -> 20.7 against the heuristic's pair tiles), its decode at batch 1 3.31 -> 3.24 ms twice, arms
# alternated (8 rows of 256 at that layer; one H100, 2026-12-06, docs/moe.md). KILN_MOE_STREAM=0: the table's config.
STREAM_ONE_TOKEN = os.environ.get("KILN_MOE_STREAM", "1") == "1"
# Hidden elements a program (one warp: a 16-byte vector a thread and pair row) of the grouped path's sum over a
# token's pairs. Qwen3-30B-A3B's layer at 8 / 64 tokens: 1.5 / 2.2 us, against 5.0 / 5.4 with 1024 (16 programs at 8
# tokens, a branch around each pair's load) and Inductor's 1.6 / 5.7 (one H100, 2026-12-07, bench_profile).
SUM_BLOCK = 256


def one_token_config(top_k: int, inter: int, hidden: int, element_bytes: int,
                     device: torch.device) -> MoeKernelConfig:
    """The pair kernels' config for one token's k pairs: the streaming kernel's rule over all k experts' gate rows
    (it shapes the gate/up kernel; the down kernel's tile is token_down_tile's)."""
    from kiln.models.quant.fp8_kernel import num_sms

    rule = gemv_stream.pick_config(top_k * inter, hidden, num_sms(device), element_bytes)
    return MoeKernelConfig(1, rule.rows, rule.block_k, rule.num_warps, rule.num_stages)


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b (the kernels' one product)."""
    if IEEE:  # fp32 models: no TF32 rounding
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _block(pid_m, sorted_ptr, block_expert_ptr, ids_ptr, num_pairs, NUM_E, BLOCK_M: tl.constexpr,
           PAIR_BLOCKS: tl.constexpr):
    """(expert, pairs [BLOCK_M]) of layout block pid_m: read from align's output (experts in order, each expert's
    pairs in pair order, padded to whole blocks, padding rows holding num_pairs), or (PAIR_BLOCKS) pair pid_m alone
    in row 0. An expert >= NUM_E: the block holds no pairs."""
    if PAIR_BLOCKS:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        expert = tl.minimum(tl.load(ids_ptr + pid_m), NUM_E)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert.to(tl.int64), pairs


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gate_up_kernel(x_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, h_ptr, num_pairs, H,
                            INTER, NUM_E, s_xt, s_we, s_wn, s_ht, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                            IEEE: tl.constexpr, PAIR_BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs = _block(pid_m, sorted_ptr, block_expert_ptr, ids_ptr, num_pairs, NUM_E, BLOCK_M, PAIR_BLOCKS)
    if expert >= NUM_E:
        return
    m_mask = pairs < num_pairs
    tokens = (pairs // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * s_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * s_we + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * s_wn
    if SCALED:  # before the K loop, whose end they would otherwise wait for (a DRAM round trip)
        g_scale = tl.load(ws_ptr + expert * 2 * INTER + offs_n, mask=n_mask, other=0.0)
        u_scale = tl.load(ws_ptr + expert * 2 * INTER + INTER + offs_n, mask=n_mask, other=0.0)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = k0 + offs_k < H
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
        u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
        acc_g = mma(a, g, acc_g, IEEE)
        acc_u = mma(a, u, acc_u, IEEE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALED:
        acc_g *= g_scale[None, :]
        acc_u *= u_scale[None, :]
    h = _silu_mul(acc_g, acc_u)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * s_ht + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_down_kernel(h_ptr, w_ptr, ws_ptr, tw_ptr, sorted_ptr, block_expert_ptr, ids_ptr, y_ptr, num_pairs, H,
                         INTER, NUM_E, s_ht, s_we, s_wn, s_yt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr,
                         PAIR_BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs = _block(pid_m, sorted_ptr, block_expert_ptr, ids_ptr, num_pairs, NUM_E, BLOCK_M, PAIR_BLOCKS)
    if expert >= NUM_E:
        return
    m_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None].to(tl.int64) * s_ht + offs_k[None, :]
    b_ptrs = w_ptr + expert * s_we + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]
    pair_weights = tl.load(tw_ptr + pairs, mask=m_mask, other=0.0)  # before the K loop, as the scales
    if SCALED:
        scales = tl.load(ws_ptr + expert * H + offs_n, mask=n_mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_mask = k0 + offs_k < INTER
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
        acc = mma(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALED:
        acc *= scales[None, :]
    acc *= pair_weights[:, None]
    y_ptrs = y_ptr + pairs[:, None].to(tl.int64) * s_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _load_step(ptrs, mask, EVEN: tl.constexpr):
    """One K step's tile of the pair kernels; EVEN: every row and K index in bounds, no mask."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, H, INTER, NUM_E, s_xt, s_we, s_wn, s_ht,
                         TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                         EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (pair, n): h[pair, rows] for BLOCK_N rows of the pair's expert, gate rows and the up rows INTER
    below. The products accumulate element-wise in [BLOCK_N, BLOCK_K] and are summed once after the K loop (a sum
    every step costs more shuffles than the loads it waits on)."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert >= NUM_E:
        return
    x_ptrs = x_ptr + (pair // TOPK).to(tl.int64) * s_xt + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * s_we + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * s_wn
    if SCALED:  # before the K loop, whose end they would otherwise wait for (a DRAM round trip)
        g_scale = tl.load(ws_ptr + expert * 2 * INTER + offs_n, mask=n_mask, other=0.0)
        u_scale = tl.load(ws_ptr + expert * 2 * INTER + INTER + offs_n, mask=n_mask, other=0.0)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):  # EVEN: INTER % BLOCK_N == 0 and H % BLOCK_K == 0
        k_mask = k0 + offs_k < H
        # the weights' loads before the token's, as gemv_stream.py orders them: 29.8 -> 28.6 us a layer at one
        # token (Qwen3-30B-A3B's experts, bf16, one H100, 2026-12-06; docs/moe.md)
        g = _load_step(g_ptrs, n_mask[:, None] & k_mask[None, :], EVEN)
        u = _load_step(u_ptrs, n_mask[:, None] & k_mask[None, :], EVEN)
        a = _load_step(x_ptrs, k_mask, EVEN).to(tl.float32)[None, :]
        acc_g += g.to(tl.float32) * a
        acc_u += u.to(tl.float32) * a
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    if SCALED:
        gate *= g_scale
        up *= u_scale
    h = _silu_mul(gate, up)
    tl.store(h_ptr + pair.to(tl.int64) * s_ht + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _token_down_kernel(h_ptr, w_ptr, ws_ptr, tw_ptr, ids_ptr, y_ptr, H, INTER, NUM_E, s_ht, s_we, s_wn, s_yt,
                       TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALED: tl.constexpr, MASKED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, n): y[token, rows] = the sum over the token's k pairs of each pair's weighted row, for BLOCK_N
    rows of W_down. A K step loads the same [BLOCK_N, BLOCK_K] tile of every pair's expert at once, [TOPK_POW2,
    BLOCK_N, BLOCK_K], and the products accumulate element-wise, summed once after the K loop (as the gate/up kernel
    sums). A pair on another rank's expert (id >= NUM_E) loads nothing and adds nothing. MASKED: some row, K index
    or slot is out of bounds or on another rank (else the loads go unmasked). The routing (ids, pair weights) is
    loaded before the PDL wait: the top-k kernel wrote it before the gate/up kernel, which is all the wait waits
    for, so the weight's first loads follow the wait without a round trip for the ids first."""
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, TOPK_POW2)
    pairs = token * TOPK + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOPK, other=NUM_E).to(tl.int64)
    live = experts < NUM_E
    experts = tl.where(live, experts, 0)  # in bounds; the slot's loads are masked off
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + experts[:, None, None] * s_we + offs_n[None, :, None].to(tl.int64) * s_wn
              + offs_k[None, None, :])
    h_ptrs = h_ptr + pairs[:, None] * s_ht + offs_k[None, :]
    pair_weights = tl.load(tw_ptr + pairs, mask=live, other=0.0)  # before the K loop, as the scales
    if SCALED:
        scales = tl.load(ws_ptr + experts[:, None] * H + offs_n[None, :], mask=live[:, None] & n_mask[None, :],
                         other=0.0)
    pdl_start(PDL)  # h, the gate/up kernel's, is read after it
    acc = tl.zeros((TOPK_POW2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if MASKED:
            k_mask = live[:, None] & (k0 + offs_k < INTER)[None, :]
            w = tl.load(w_ptrs, mask=k_mask[:, None, :] & n_mask[None, :, None], other=0.0)  # the weight first
            a = tl.load(h_ptrs, mask=k_mask, other=0.0)
        else:
            w = tl.load(w_ptrs)
            a = tl.load(h_ptrs)
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    rows = tl.sum(acc, 2)  # [TOPK_POW2, BLOCK_N]: each pair's row
    if SCALED:
        rows *= scales
    rows *= pair_weights[:, None]
    tl.store(y_ptr + token * s_yt + offs_n, tl.sum(rows, 0).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sum_pairs_kernel(y_ptr, ids_ptr, out_ptr, H, NUM_E, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                      REMOTE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, block): out[token, block] = the sum of the token's k pair rows (y [T * k, H]) in fp32, rounded
    once. REMOTE: a pair on another rank's expert (id >= NUM_E) has an unwritten row, read and replaced by zeros (a
    branch around its load would serialize the k loads; the unmasked loads stay in flight together)."""
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        row = tl.load(y_ptr + pair * H + offs, mask=mask, other=0.0).to(tl.float32)
        if REMOTE:
            row = tl.where(tl.load(ids_ptr + pair) < NUM_E, row, 0.0)
        acc += row
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def token_down_tile(top_k: int, inter: int, hidden: int, element_bytes: int, device: torch.device) -> tuple[int, int]:
    """(rows a program, K elements of each pair's expert a step) of the pair path's down kernel: the streaming
    kernel's rule over the token's hidden rows with its k experts' K side by side (a step's tile holds every pair's)."""
    from kiln.models.quant.fp8_kernel import num_sms

    slots = triton.next_power_of_2(top_k)
    rule = gemv_stream.pick_config(hidden, slots * inter, num_sms(device), element_bytes)
    return rule.rows, min(triton.next_power_of_2(inter), max(16, rule.block_k // slots))


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, remote_experts: bool = False,
                     config: MoeKernelConfig | None = None) -> torch.Tensor:
    """The same contract as fused_moe_reference (reference.py), on the Triton kernels."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden size {hidden}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights: the input dimension must be contiguous")
    if config is None and num_tokens == 1 and STREAM_ONE_TOKEN and not gemv.is_suspended():
        config = one_token_config(top_k, inter, hidden, w13.element_size(), x.device)
    config = config or pick_config(num_experts, inter, hidden, top_k, num_tokens, w13.dtype)
    x = x.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.float().contiguous()
    scaled = w13_scale is not None
    ws13, ws2 = (w13_scale.float().contiguous(), w2_scale.float().contiguous()) if scaled else (tw, tw)
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return x.new_empty((0, hidden))
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device))
    if config.block_m == 1:
        _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, config.block_n))](
            x, w13, ws13, ids, h, hidden, inter, num_experts, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            TOPK=top_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SCALED=scaled,
            EVEN=inter % config.block_n == 0 and hidden % config.block_k == 0, **launch)
        y = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)  # every row written
        rows, block_k = token_down_tile(top_k, inter, hidden, w2.element_size(), x.device)
        slots = triton.next_power_of_2(top_k)
        _token_down_kernel[(num_tokens, triton.cdiv(hidden, rows))](
            h, w2, ws2, tw, ids, y, hidden, inter, num_experts, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
            TOPK=top_k, TOPK_POW2=slots, BLOCK_N=rows, BLOCK_K=block_k, SCALED=scaled,
            MASKED=remote_experts or slots != top_k or hidden % rows != 0 or inter % block_k != 0, **launch)
        return y
    pair_blocks = num_tokens <= PAIR_BLOCK_TOKENS
    if pair_blocks:  # block j = pair j, its expert from the ids
        sorted_pairs = block_expert = ids  # unread
        blocks = num_pairs
    else:
        align = align_by_expert_triton if num_pairs <= MAX_PAIRS else align_by_expert
        sorted_pairs, block_expert = align(ids, num_experts, config.block_m)
        blocks = block_expert.numel()
    layout = dict(IEEE=x.dtype == torch.float32, PAIR_BLOCKS=pair_blocks)
    _grouped_gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](
        x, w13, ws13, sorted_pairs, block_expert, ids, h, num_pairs, hidden, inter, num_experts, x.stride(0),
        w13.stride(0), w13.stride(1), h.stride(0), TOPK=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SCALED=scaled, **layout, **launch)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)  # rows of other ranks' experts unwritten
    _grouped_down_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        h, w2, ws2, tw, sorted_pairs, block_expert, ids, y, num_pairs, hidden, inter, num_experts, h.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SCALED=scaled, **layout, **launch)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK))](
        y, ids, out, hidden, num_experts, TOPK=top_k, BLOCK=SUM_BLOCK, REMOTE=remote_experts, num_warps=1,
        **pdl_launch(x.device))
    return out
