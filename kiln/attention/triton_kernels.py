"""Triton kernels for paged attention over the [num_blocks, 2, block_size, Hkv, D] KV cache.

Every launch grid depends only on host-side sizes that are fixed for a CUDA-graph batch descriptor
(padded token count, request count, head counts); per-request lengths are read from device tensors
inside the kernels. That is what makes the whole backend capturable. GQA is handled by packing the
query heads that share a KV head into the rows of one tile, so each K/V tile is loaded once per group.
Scores are kept in the log2 domain (scale pre-multiplied by log2(e)) so the softmax uses exp2.

An fp8 (e4m3) cache (KV_FP8) stores clamp(x / scale, +-448) (kiln/models/kv_quant.py). Reads convert a tile
to q's dtype (exact: every e4m3 value is a bf16/fp16/fp32 value) so both tl.dot operands share a dtype, and
the layer's scales are applied outside the dots: k_scale is folded into qk_scale by the host, and v_scale
multiplies the output once (attention is linear in V), so a tile costs one conversion and no multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.models.pdl import pdl_start
from kiln.models.rope_triton import rotate


@triton.jit
def _fp8_units(x, scale):
    """x -> clamp(x / scale, +-448) in fp32: what an e4m3 cache stores, before the cast."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)


@triton.jit
def reshape_and_cache_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, k_scale, v_scale,
                             HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # explicit "no write" marker; the runner normally sends padding to the null block
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        k = _fp8_units(k, k_scale)
        v = _fp8_units(v, v_scale)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, cache_ptr, kv_base, n0, kv_end, bt_row_ptr, q_pos, d, d_mask, stride_cb,
                 stride_cs, stride_ckv, qk_scale, MASK: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr, KV_FP8: tl.constexpr, new_pos=0, k_new=None, v_new=None,
                 NEW: tl.constexpr = False):
    """One online-softmax step over keys [n0, n0 + BLOCK_N) gathered through the block table.

    MASK applies the end bound and causality (key position <= query position); interior tiles skip it.
    KV_FP8: the tiles are e4m3, converted to q's dtype; qk_scale carries k_scale, the caller applies v_scale.
    NEW: the key/value at new_pos are k_new/v_new (in the cache's dtype), not what the cache holds there yet.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    block = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    tok = kv_base + block * stride_cb + (offs_n % PAGE) * stride_cs  # [BLOCK_N]
    k = tl.load(cache_ptr + tok[None, :] + d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    if NEW:
        k = tl.where(offs_n[None, :] == new_pos, k_new[:, None], k)
    if KV_FP8:
        k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if MASK:
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen no visible key yet (a split of a multi-token decode starting past its position)
    # keeps m = -inf; subtracting 0 instead keeps its p and alpha a clean 0 rather than NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(cache_ptr + stride_ckv + tok[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                other=0.0)
    if NEW:
        v = tl.where(offs_n[:, None] == new_pos, v_new[None, :], v)
    if KV_FP8:
        v = v.to(q.dtype)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_reqs", "qb0"])
def varlen_attention_kernel(q_ptr, out_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, num_reqs, qb0, qk_scale,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ckv, stride_cs, stride_ch,
                            stride_bt, v_scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            PAGE: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = False):
    """Causal attention for any mix of requests; program (q_block, kv_head).

    Request i owns q-blocks [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): an upper bound on its
    ceil(q_len / BLOCK_Q) blocks that needs no host-side prefix sum, so the grid is
    num_tokens // BLOCK_Q + num_reqs and a program finds its request by binary search. The requests may
    start after a batch's leading decodes (qsl_ptr past them, qsl still absolute): qb0 = qsl[0] // BLOCK_Q
    is then the first block, and the grid that much smaller.
    """
    pdl_start(PDL)
    qb = tl.program_id(0) + qb0
    kv_head = tl.program_id(1)
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= qb, mid, lo)
        hi = tl.where(first <= qb, hi, mid - 1)
    req = lo
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_off = (qb - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if q_off >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # tokens already in the cache before this step's queries

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_off + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = context + tok

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    kv_base = kv_head * stride_ch
    kv_end = context + tl.minimum(q_off + BLOCK_Q, q_len)
    # keys below the first query of this tile are visible to every row: no mask needed there
    full_end = ((context + q_off) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, cache_ptr, kv_base, n0, kv_end, bt_row, q_pos, d, d_mask,
                                     stride_cb, stride_cs, stride_ckv, qk_scale, False, PAGE, BLOCK_N, IEEE,
                                     KV_FP8)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, cache_ptr, kv_base, n0, kv_end, bt_row, q_pos, d, d_mask,
                                     stride_cb, stride_cs, stride_ckv, qk_scale, True, PAGE, BLOCK_N, IEEE,
                                     KV_FP8)
    acc = acc / l_i[:, None]
    if KV_FP8:
        acc = acc * v_scale
    o_ptrs = out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _norm_rope(x, partner, d, cos, sin, w, wp, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Dims d of heads x (rows along the last axis; `partner` holds their dims d + HEAD_DIM / 2 mod HEAD_DIM), with
    NORM RMS-normed by weights w (wp: the partner dims'), rotated by cos / sin (each dim's of its pair), in x's
    dtype: the arithmetic and roundings of kiln's norm + RoPE kernel (kiln/passes/kernels.py)."""
    dtype = x.dtype
    x = x.to(tl.float32)
    partner = partner.to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / HEAD_DIM + eps)
        x = (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        partner = (wp * (partner * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (kiln/models/rope_triton.py: rounded as that kernel)
    return rotate(x, tl.where(d < HEAD_DIM // 2, -partner, partner), cos, sin).to(dtype)


@triton.jit
def _load_pair(ptr, d, HEAD_DIM: tl.constexpr):
    """ptr[d] and ptr[d + HEAD_DIM / 2 mod HEAD_DIM] in fp32 (a norm weight and its rotation partner's)."""
    mask = d < HEAD_DIM
    return (tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32),
            tl.load(ptr + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def decode_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, cache_ptr, bt_ptr,
                            seq_lens_ptr, slot_ptr, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                            stride_vh, stride_ot, stride_oh, stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
                            k_scale, v_scale, rope_ptr, qw_ptr, kw_ptr, stride_rope, norm_eps,
                            GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr,
                            IEEE: tl.constexpr, KV_FP8: tl.constexpr, QLEN: tl.constexpr = 1,
                            ROPE: tl.constexpr = False, NORM: tl.constexpr = False, PDL: tl.constexpr = False):
    """QLEN new tokens per request (1: decode; more: a speculative verify); program (request, kv_head x QLEN
    + token, split).

    At small batch a decode layer is latency-bound, so the KV write is fused in: split 0 writes the new
    key/value and the split holding its position takes it from k/v. With splits, merge_splits_kernel (a launch
    of its own, a program per (token, head)) merges the partials. The split count is fixed per request count
    (not per context length) so a CUDA graph captured for a batch size stays valid as contexts grow; each split
    sizes its slice from seq_len, at least MIN_TILES tiles, so a short context may occupy only its first
    splits: the rest find no keys and their partials (o = 0, lse = -inf) weigh 0 in the merge.
    KV_FP8: the new key/value are taken in cache units (quantized and read back, as a later step reads
    them from the cache), so a step's output does not depend on which path a key came through.

    ROPE (QLEN 1 only): q and the new key come before their rotation (neox halves, the cos / sin row of `rope_ptr`
    at the new position, seq_len - 1) and, with NORM, before a per-head RMSNorm (weights qw / kw); every split rotates
    its program's rows itself, the same arithmetic as kiln's separate kernel (kiln/passes/kernels.py), so the kernel
    before this one is the projection and no RoPE kernel runs. The row, the weights and seq_len are loaded before
    the PDL wait: no kernel of the step writes them (the runner's buffers, constants).

    QLEN > 1: the caller has written the QLEN new keys/values to the cache (k, v and slot are unused), and
    token t of a request, seeing the keys up to its position seq_len - QLEN + t, gets programs of its own: the
    verify of k proposals splits its context over the SMs as a decode does, and each token sits in the rows a
    decode of it uses and runs the decode's arithmetic (same tiles, same layouts; the decode's new key goes
    through the tile too), so its attention is the one a decode at its position computes, bit for bit
    (16-bit on the H200; not fp32's IEEE dots there), except where the tokens straddle a change of the tiles
    per split (every NUM_SPLITS x BLOCK_N keys). Packing several tokens into a program's rows read the context
    fewer times but changed a row's rounding with its place in the tile.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // QLEN
    t = tl.program_id(1) % QLEN  # this program's token of the request
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1) // QLEN
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    if ROPE:  # before the wait: no kernel of the step writes seq_lens, the cos / sin cache or the norm weights
        seq_len = tl.load(seq_lens_ptr + req)
        rope_row = rope_ptr + (seq_len - 1).to(tl.int64) * stride_rope
        cos = tl.load(rope_row + d % (HEAD_DIM // 2), mask=d_mask, other=0.0)
        sin = tl.load(rope_row + HEAD_DIM // 2 + d % (HEAD_DIM // 2), mask=d_mask, other=0.0)
        if NORM:
            qw, qwp = _load_pair(qw_ptr, d, HEAD_DIM)
            kw, kwp = _load_pair(kw_ptr, d, HEAD_DIM)
        else:  # unread
            qw, qwp, kw, kwp = cos, cos, cos, cos
    pdl_start(PDL)
    if not ROPE:
        seq_len = tl.load(seq_lens_ptr + req)
    new_pos = seq_len - 1
    if QLEN == 1:
        k_row = k_ptr + req.to(tl.int64) * stride_kt + kv_head * stride_kh
        k_new = tl.load(k_row + d, mask=d_mask, other=0.0)
        if ROPE:
            k_new = _norm_rope(k_new, tl.load(k_row + (d + HEAD_DIM // 2) % HEAD_DIM, mask=d_mask, other=0.0), d,
                               cos, sin, kw, kwp, norm_eps, HEAD_DIM, NORM)
        v_new = tl.load(v_ptr + req.to(tl.int64) * stride_vt + kv_head * stride_vh + d, mask=d_mask, other=0.0)
        if KV_FP8:  # to e4m3: the values the cache holds, in units of the scales
            k_new = _fp8_units(k_new, k_scale)
            v_new = _fp8_units(v_new, v_scale)
        k_new = k_new.to(cache_ptr.dtype.element_ty)
        v_new = v_new.to(cache_ptr.dtype.element_ty)
        if split == 0:
            slot = tl.load(slot_ptr + req).to(tl.int64)
            if slot >= 0:
                dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kv_head * stride_ch + d
                tl.store(dst, k_new, mask=d_mask)
                tl.store(dst + stride_ckv, v_new, mask=d_mask)
    else:
        k_new = tl.zeros([BLOCK_D], dtype=cache_ptr.dtype.element_ty)
        v_new = k_new

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), MIN_TILES)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    h_mask = h < GROUP
    token = req.to(tl.int64) * QLEN + t + tl.zeros([BLOCK_H], dtype=tl.int64)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if ROPE:
        q = _norm_rope(q, tl.load(q_rows + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :],
                                  mask=h_mask[:, None] & d_mask[None, :], other=0.0),
                       d[None, :], cos[None, :], sin[None, :], qw[None, :], qwp[None, :], norm_eps, HEAD_DIM, NORM)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    q_pos = (seq_len - QLEN + t + tl.zeros([BLOCK_H], dtype=tl.int32)).to(tl.int32)  # the context up to itself
    kv_base = kv_head * stride_ch
    # tiles before the first new token are unmasked; from its tile on, the mask applies (a decode's new key
    # comes from k/v in that tile, since split 0 may still be writing it to the cache)
    plain_end = start + tl.maximum(tl.minimum(end, seq_len - QLEN) - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, plain_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, cache_ptr, kv_base, n0, end, bt_row, q_pos, d, d_mask,
                                     stride_cb, stride_cs, stride_ckv, qk_scale, False, PAGE, BLOCK_N, IEEE,
                                     KV_FP8)
    for n0 in range(plain_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, cache_ptr, kv_base, n0, end, bt_row, q_pos, d, d_mask,
                                     stride_cb, stride_cs, stride_ckv, qk_scale, True, PAGE, BLOCK_N, IEEE,
                                     KV_FP8, new_pos, k_new, v_new, QLEN == 1)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # an empty split leaves acc == 0, so o == 0
    if KV_FP8:
        o = o * v_scale
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        base = (token * (GROUP * num_kv_heads) + head) * NUM_SPLITS  # partials are [tokens, heads, splits]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + base + split, lse, mask=h_mask)
        tl.store(part_o_ptr + (base + split)[:, None].to(tl.int64) * HEAD_DIM + d[None, :], o, mask=out_mask)


@triton.jit
def merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                        PDL: tl.constexpr = False):
    """The decode's split merge, program (token, head, BLOCK_D dims of the head): its NUM_SPLITS partials weighed by
    their log-sum-exps (every chunk of a head computes the same weights, so the chunks only share the reads).
    It reads all NUM_SPLITS rows: masking it to the splits holding keys measured 8-12% slower at batch 1 on the
    H200 and no faster at batch 8-64 (an in-process A/B of the merge then fused into the decode kernel,
    bench_attention --vary merge_active at commit 2531019, 2026-11-30)."""
    pdl_start(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    sp = tl.arange(0, BLOCK_S)
    sp_mask = sp < NUM_SPLITS
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=sp_mask, other=float("-inf"), cache_modifier=".cg")
    # issued with the log-sum-exps, not after their max (the PTX order; an L2 round trip of its own there)
    part = tl.load(part_o_ptr + row[:, None].to(tl.int64) * HEAD_DIM + d[None, :], cache_modifier=".cg",
                   mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    total = tl.sum(w, axis=0)
    merged = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def page_indices_kernel(bt_ptr, seq_lens_ptr, out_ptr, stride_bt, PAGE: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Flatten each request's used block-table prefix into one index array (FlashInfer's kv_indices).

    The offset of request i is a prefix sum of page counts computed in-kernel, so no host sync is needed.
    """
    pdl_start(PDL)
    req = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    lens = tl.load(seq_lens_ptr + r, mask=r < req, other=0)
    start = tl.sum((lens + PAGE - 1) // PAGE, axis=0)
    n = (tl.load(seq_lens_ptr + req) + PAGE - 1) // PAGE
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + start + offs, tl.load(bt_ptr + req.to(tl.int64) * stride_bt + offs, mask=m), mask=m)
