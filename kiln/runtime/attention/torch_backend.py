"""The reference backend: plain torch, runs anywhere, the correctness oracle for the others.

Requests attend in batched SDPA calls over their gathered blocks, padded to the longest query and
context of the call and masked (causal, with each query offset by the tokens already in the cache):
all single-token (decode) requests in one call, the longer ones in another when padding them together
costs at most twice their own work, else one call each (a lone request takes a plain, unpadded path).
Simple and exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.models.attention_op import write_kv
from kiln.runtime.attention.base import AttentionBackend, CommonAttentionMetadata, GraphSupport


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_support = GraphSupport.NEVER  # groups requests by CPU-side lengths read every step
    supports_cache_only = True

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        return common

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: CommonAttentionMetadata) -> None:
        if k is not None and v is not None:  # None: already written by a fused RoPE + cache write
            write_kv(k, v, kv_cache, metadata.slot_mapping)
        starts = metadata.query_start_loc_cpu.tolist()
        lens = metadata.seq_lens_cpu.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(metadata.num_reqs)]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        longer = [i for i, n in enumerate(q_lens) if n > 1]
        groups = [decodes] if decodes else []
        padded = len(longer) * max((q_lens[i] for i in longer), default=0) * max((lens[i] for i in longer), default=0)
        if padded <= 2 * sum(q_lens[i] * lens[i] for i in longer):
            groups.append(longer)
        else:  # e.g. one long prompt beside short chunks: padding them together would dwarf the work
            groups.extend([i] for i in longer)
        for rows in groups:
            if len(rows) == 1:  # fewer small ops than the padded path: this is every step at batch 1
                i = rows[0]
                self._one_request(q, out, kv_cache, metadata.block_tables[i], starts[i], starts[i + 1], lens[i])
            elif rows:
                self._attend(q, out, kv_cache, metadata.block_tables, [starts[i] for i in rows],
                             [q_lens[i] for i in rows], [lens[i] for i in rows], rows)

    def _one_request(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor,
                     q_start: int, q_end: int, seq_len: int) -> None:
        layout = self.layout
        blocks = block_row[: -(-seq_len // layout.block_size)].long()
        keys = kv_cache[blocks, 0].reshape(-1, layout.num_kv_heads, layout.head_dim)[:seq_len].transpose(0, 1)
        values = kv_cache[blocks, 1].reshape(-1, layout.num_kv_heads, layout.head_dim)[:seq_len].transpose(0, 1)
        q_len = q_end - q_start
        # query token j sits at position (seq_len - q_len + j) and sees keys at positions <= that
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=seq_len - q_len)
        attn = F.scaled_dot_product_attention(q[q_start:q_end].transpose(0, 1), keys, values, attn_mask=mask,
                                              scale=layout.scale, enable_gqa=True)
        out[q_start:q_end] = attn.transpose(0, 1)

    def _attend(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                starts: list[int], q_lens: list[int], lens: list[int], rows: list[int]) -> None:
        """Causal attention for these requests in one SDPA call, padded to the longest query and context."""
        layout, device = self.layout, q.device
        num_blocks = -(-max(lens) // layout.block_size)
        blocks = block_tables[torch.tensor(rows, device=device), :num_blocks].long()  # [R, n]

        def gather(which: int) -> torch.Tensor:  # [R, Hkv, L, D]
            x = kv_cache[blocks, which].reshape(len(rows), -1, layout.num_kv_heads, layout.head_dim)
            return x.transpose(1, 2)

        keys, values = gather(0), gather(1)
        width = max(q_lens)
        j = torch.arange(width, device=device)
        q_len_t, len_t = torch.tensor(q_lens, device=device), torch.tensor(lens, device=device)
        real = j[None, :] < q_len_t[:, None]  # [R, width]: which query slots are tokens
        tokens = torch.tensor(starts, device=device)[:, None] + torch.where(real, j[None, :], 0)
        key_pos = torch.arange(keys.shape[2], device=device)
        in_context = key_pos[None, :] < len_t[:, None]  # [R, L]
        # slots past a request's context hold whatever was there (another request's K/V, NaN in tests):
        # zero them so a masked position contributes exactly nothing (0 * NaN would not)
        keys = keys.masked_fill(~in_context[:, None, :, None], 0.0)
        values = values.masked_fill(~in_context[:, None, :, None], 0.0)
        # query slot j of request r sits at position len - q_len + j and sees keys up to there;
        # padding slots see position 0 only (a fully masked row would be NaN), and are not written
        query_pos = (len_t - q_len_t)[:, None] + j[None, :]
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & real[:, :, None]
        mask[:, :, 0] |= ~real
        query = q[tokens].transpose(1, 2)  # [R, H, width, D]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=layout.scale,
                                              enable_gqa=True)  # query heads share KV heads without copies
        out[tokens[real]] = attn.transpose(1, 2)[real]
