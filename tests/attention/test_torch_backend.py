"""The torch reference backend against a naive float64 softmax attention written out here, on random paged
batches whose unowned cache slots are NaN: however requests are grouped into padded SDPA calls, each reads
only its own context."""

from __future__ import annotations

import pytest
import torch

from kiln.attention.torch_backend import TorchAttentionBackend
from tests.attention.paged_batch import PagedBatch, make_batch, run_backend


def naive(batch: PagedBatch) -> torch.Tensor:
    layout, common = batch.layout, batch.common
    cache = batch.kv_cache.clone()
    slots = common.slot_mapping[: batch.num_tokens]
    cache[slots // layout.block_size, 0, slots % layout.block_size] = batch.k[: batch.num_tokens]
    cache[slots // layout.block_size, 1, slots % layout.block_size] = batch.v[: batch.num_tokens]
    group = layout.num_heads // layout.num_kv_heads
    out = torch.empty(batch.num_tokens, layout.num_heads, layout.head_dim, dtype=torch.float64)
    starts, lens = common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
    for i in range(common.num_reqs):
        for t in range(starts[i], starts[i + 1]):
            pos = lens[i] - (starts[i + 1] - t)  # this token's position; it sees positions 0..pos
            seen = torch.arange(pos + 1)
            slot = common.block_tables[i, seen // layout.block_size].long() * layout.block_size + \
                seen % layout.block_size
            keys = cache[slot // layout.block_size, 0, slot % layout.block_size].double()  # [n, Hkv, D]
            values = cache[slot // layout.block_size, 1, slot % layout.block_size].double()
            for h in range(layout.num_heads):
                scores = keys[:, h // group] @ batch.q[t, h].double() * layout.scale
                out[t, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("q_lens, contexts", [
    ([1, 1, 1, 1, 1], [0, 7, 40, 16, 100]),  # all decodes: one batched call
    ([1, 9, 1, 1, 30, 1], [33, 0, 5, 64, 12, 1]),  # decodes in one call, the chunks padded together in another
    ([1, 4], [50, 3]),  # groups of one
    ([60, 2, 1], [0, 3, 9]),  # padding 60 with 2 would more than double the work: one call each
])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 16), (8, 2, 32)])
def test_torch_backend_matches_naive_attention(q_lens, contexts, num_heads, num_kv_heads, head_dim) -> None:
    batch = make_batch(q_lens, contexts, num_heads, num_kv_heads, head_dim, torch.float32, block_size=8)
    out, _ = run_backend(TorchAttentionBackend(batch.layout, torch.device("cpu")), batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive(batch), atol=1e-5, rtol=1e-5)
