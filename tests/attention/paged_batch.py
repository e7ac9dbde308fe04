"""Random paged batches for attention-backend tests (shared by the CPU interpreter and GPU tests).

A batch scatters each request's blocks over a pool twice the needed size (holes between them, random
order), leaves trailing block-table entries on the null block, pads the token dimension, and fills
every cache slot the batch does not own with NaN, so a kernel that reads outside a request's context
poisons its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.attention.base import AttentionBackend, AttentionLayout, CommonAttentionMetadata


@dataclass
class PagedBatch:
    layout: AttentionLayout
    q: torch.Tensor  # [T_padded, H, D]
    k: torch.Tensor  # [T_padded, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, Hkv, D]
    common: CommonAttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.common.num_tokens


def make_batch(q_lens: list[int], contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str | torch.device = "cpu", block_size: int = 16, pad_tokens: int = 3,
               seed: int = 0, poison: float = float("nan"), num_blocks: int | None = None,
               width: int | None = None) -> PagedBatch:
    """`poison` fills unowned slots; `num_blocks`/`width` fix the shapes (to reuse graph buffers)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = num_blocks or 1 + 2 * sum(blocks_per_req)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = width or max(blocks_per_req) + 2
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        tables[i, :n] = torch.tensor(perm[cursor:cursor + n], dtype=torch.int32)
        cursor += n
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), poison, dtype=torch.float32)
    slots = []
    for i, (ctx, n) in enumerate(zip(contexts, q_lens)):
        pos = torch.arange(ctx + n)
        slot = tables[i, pos // block_size].long() * block_size + pos % block_size
        blk, off = slot[:ctx] // block_size, slot[:ctx] % block_size
        cache[blk, :, off] = torch.randn(ctx, 2, num_kv_heads, head_dim, generator=g)
        slots.append(slot[ctx:])
    num_tokens = sum(q_lens)
    total = num_tokens + pad_tokens
    slot_mapping = torch.cat(slots + [torch.zeros(pad_tokens, dtype=torch.long)])
    q = torch.randn(total, num_heads, head_dim, generator=g)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_reqs=len(q_lens), num_tokens=num_tokens, query_start_loc=qsl.to(device), seq_lens=lens.to(device),
        block_tables=tables.to(device), slot_mapping=slot_mapping.to(device), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        uniform_decode=all(n == 1 for n in q_lens))
    layout = AttentionLayout(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, block_size, dtype)
    cast = dict(dtype=dtype, device=device)
    return PagedBatch(layout, q.to(**cast), k.to(**cast), v.to(**cast), cache.to(**cast), common)


def run_backend(backend: AttentionBackend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(out for the real tokens, the cache after the step); the batch's tensors are left untouched."""
    cache = batch.kv_cache.clone()
    out = torch.full_like(batch.q, float("nan"))
    backend.forward(batch.q, batch.k, batch.v, out, cache, backend.build_metadata(batch.common))
    return out[: batch.num_tokens], cache


def reference(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend on fp32 copies: the oracle for every dtype."""
    from kiln.attention.torch_backend import TorchAttentionBackend

    layout = AttentionLayout(batch.layout.num_heads, batch.layout.num_kv_heads, batch.layout.head_dim,
                             batch.layout.scale, batch.layout.block_size, torch.float32)
    fp32 = PagedBatch(layout, batch.q.float(), batch.k.float(), batch.v.float(), batch.kv_cache.float(), batch.common)
    return run_backend(TorchAttentionBackend(layout, batch.q.device), fp32)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()
