"""The reference backend: plain torch, runs anywhere, the correctness oracle for the others.

Per request it gathers the request's blocks, then runs causal SDPA with the query offset by the
number of tokens already in the cache. Slow, simple, and exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime.attention.base import AttentionBackend, CommonAttentionMetadata, GraphSupport, write_kv


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_support = GraphSupport.NEVER  # per-request Python loop over CPU-side lengths
    supports_cache_only = True

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        return common

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: CommonAttentionMetadata) -> None:
        if k is not None and v is not None:  # None: already written by a fused RoPE + cache write
            write_kv(k, v, kv_cache, metadata.slot_mapping)
        layout = self.layout
        block_size = layout.block_size
        group = layout.num_heads // layout.num_kv_heads
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i in range(metadata.num_reqs):
            q_start, q_end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = metadata.block_tables[i, :num_blocks].long()
            keys = kv_cache[blocks, 0].reshape(-1, layout.num_kv_heads, layout.head_dim)[:seq_len]
            values = kv_cache[blocks, 1].reshape(-1, layout.num_kv_heads, layout.head_dim)[:seq_len]
            query = q[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            # query token j sits at position (seq_len - q_len + j) and sees keys at positions <= that
            context = seq_len - q_len
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=context)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=layout.scale)
            out[q_start:q_end] = attn.transpose(0, 1)
