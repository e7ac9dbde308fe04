"""The reference backend: plain torch, runs anywhere, the correctness oracle for the others.

Requests attend in batched SDPA calls over their gathered blocks, padded to the longest query and
context of the call and masked (causal, with each query offset by the tokens already in the cache):
all single-token (decode) requests in one call, the longer ones in another when padding them together
costs at most twice their own work, else one call each (a lone request takes a plain, unpadded path).
Simple and exact.

Why a per-step plan: the grouping, block indices, masks and token indices depend only on the step's
lengths, yet every one of the model's layers needs them. Built once in `build_metadata`, a layer runs
only the gathers, SDPA and the output write; built per layer (as it first was) those small ops cost
more than the attention itself on a CPU (the 16-concurrent decode step of the embedded SmolLM2 spent
~40% of its time in them, a CPU profile of 2026-11-30 behind `42c3488`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.attention.base import AttentionBackend, CommonAttentionMetadata, GraphSupport
from kiln.models.attention_op import write_kv
from kiln.models.kv_quant import dequantize_kv


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call's inputs that do not depend on the layer: built once per step."""

    # R == 1: [n] long, the request's blocks (for keys and values); else [R * L] long, the rows of the layer's
    # cache viewed as [num_blocks * 2 * block_size, Hkv, D] that hold each request's keys, and its values
    index: torch.Tensor
    value_index: torch.Tensor
    num_reqs: int  # R
    key_len: int  # L: keys per request (the longest context of the call), or the exact context when R == 1
    queries: slice | torch.Tensor  # the query tokens: a slice of q, or [R, width] indices
    mask: torch.Tensor | None  # [R, 1, width, L] (or [q_len, L] for one request) bool; None: all keys
    written: slice | torch.Tensor  # where the output rows go in `out` (real query slots only)
    real: torch.Tensor | None  # [R, width] bool: which query slots are tokens; None: all of them


@dataclass(frozen=True)
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    calls: tuple[AttentionCall, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    graph_support = GraphSupport.NEVER  # groups requests by CPU-side lengths read every step
    supports_cache_only = True
    supports_fp8_kv = True  # an fp8 cache is dequantized as it is gathered (kiln/models/kv_quant.py)
    materializes_scores = True  # with an explicit mask and grouped KV heads SDPA may take its math path

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        starts = common.query_start_loc_cpu.tolist()
        lens = common.seq_lens_cpu.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(common.num_reqs)]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        longer = [i for i, n in enumerate(q_lens) if n > 1]
        groups = [decodes] if decodes else []
        padded = len(longer) * max((q_lens[i] for i in longer), default=0) * max((lens[i] for i in longer), default=0)
        if padded <= 2 * sum(q_lens[i] * lens[i] for i in longer):
            groups.append(longer)
        else:  # e.g. one long prompt beside short chunks: padding them together would dwarf the work
            groups.extend([i] for i in longer)
        calls = []
        for rows in groups:
            if len(rows) == 1:  # fewer small ops than the padded path: this is every step at batch 1
                i = rows[0]
                calls.append(self._one_request(common.block_tables[i], starts[i], starts[i + 1], lens[i]))
            elif rows:
                calls.append(self._padded(common.block_tables, [starts[i] for i in rows], [q_lens[i] for i in rows],
                                          [lens[i] for i in rows], rows))
        return TorchAttentionMetadata(common, tuple(calls))

    def _one_request(self, block_row: torch.Tensor, q_start: int, q_end: int, seq_len: int) -> AttentionCall:
        num_blocks = -(-seq_len // self.layout.block_size)
        q_len = q_end - q_start
        # query token j sits at position (seq_len - q_len + j) and sees keys at positions <= that; a single
        # query sees every key of its (exactly sliced) context, so it needs no mask
        mask = None
        if q_len > 1:
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=block_row.device).tril(seq_len - q_len)
        span = slice(q_start, q_end)
        blocks = block_row[:num_blocks].long()
        return AttentionCall(blocks, blocks, 1, seq_len, span, mask, span, None)

    def _padded(self, block_tables: torch.Tensor, starts: list[int], q_lens: list[int], lens: list[int],
                rows: list[int]) -> AttentionCall:
        """Causal attention for these requests in one SDPA call, padded to the longest query and context."""
        bs, device = self.layout.block_size, block_tables.device
        key_len = max(lens)
        key_pos = torch.arange(key_len, device=device)
        blocks = block_tables[torch.tensor(rows, device=device), : -(-key_len // bs)].long()  # [R, n]
        len_t, q_len_t = torch.tensor(lens, device=device), torch.tensor(q_lens, device=device)
        # Keys are gathered slot by slot. Positions past a request's context read its own position 0 instead
        # of whatever the slot holds (another request's K/V, NaN in tests): masked, a finite key contributes
        # exactly nothing, where NaN would poison the row (0 * NaN). Zeroing the gathered padding in place
        # (masked_fill_ or index_fill_ per layer) cost more than SDPA itself on a CPU.
        in_context = key_pos[None, :] < len_t[:, None]  # [R, L]
        rows_of_keys = blocks.gather(1, (key_pos // bs).expand(len(rows), -1)) * (2 * bs) + key_pos % bs
        rows_of_keys = torch.where(in_context, rows_of_keys, rows_of_keys[:, :1]).flatten()
        keys_values = (rows_of_keys, rows_of_keys + bs)
        width = max(q_lens)
        j = torch.arange(width, device=device)
        # query slot j of request r sits at position len - q_len + j and sees keys up to there;
        # padding slots see position 0 only (a fully masked row would be NaN), and are not written
        query_pos = (len_t - q_len_t)[:, None] + j[None, :]
        if width == 1 and starts == list(range(starts[0], starts[0] + len(rows))):
            # decodes in consecutive token slots (the usual order): q and out are read and written as views
            span = slice(starts[0], starts[0] + len(rows))
            return AttentionCall(*keys_values, len(rows), key_len, span, in_context[:, None, None, :], span, None)
        real = j[None, :] < q_len_t[:, None]  # [R, width]: which query slots are tokens
        tokens = torch.tensor(starts, device=device)[:, None] + torch.where(real, j[None, :], 0)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & real[:, :, None]
        mask[:, :, 0] |= ~real
        return AttentionCall(*keys_values, len(rows), key_len, tokens, mask[:, None], tokens[real], real)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchAttentionMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:
        if k is not None and v is not None:  # None: already written by a fused RoPE + cache write
            write_kv(k, v, kv_cache, metadata.common.slot_mapping, k_scale, v_scale)
        for call in metadata.calls:
            self._run(q, out, kv_cache, call, k_scale, v_scale)

    def _run(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, call: AttentionCall,
             k_scale: float, v_scale: float) -> None:
        layout = self.layout
        num_reqs, hkv, d = call.num_reqs, layout.num_kv_heads, layout.head_dim

        def gather(which: int, index: torch.Tensor) -> torch.Tensor:  # [R, Hkv, L, D] ([Hkv, L, D] if R == 1)
            if num_reqs == 1:  # whole blocks, then the context's first key_len slots
                x = kv_cache[:, which].index_select(0, index)
                return x.view(-1, hkv, d)[: call.key_len].transpose(0, 1)
            x = kv_cache.view(-1, hkv, d).index_select(0, index)  # [R * L, Hkv, D]
            return x.view(num_reqs, call.key_len, hkv, d).transpose(1, 2)

        # an fp8 cache is read back in q's dtype (only the gathered context is converted)
        keys = dequantize_kv(gather(0, call.index), k_scale, q.dtype)
        values = dequantize_kv(gather(1, call.value_index), v_scale, q.dtype)
        if call.real is None and num_reqs == 1:  # [q_len, H, D] -> [H, q_len, D]
            query = q[call.queries].transpose(0, 1)
        elif call.real is None:  # one decode per request, consecutive: [R, H, 1, D]
            query = q[call.queries].unsqueeze(2)
        else:
            query = q[call.queries].transpose(1, 2)  # [R, H, width, D]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=call.mask, scale=layout.scale,
                                              enable_gqa=True)  # query heads share KV heads without copies
        if call.real is None and num_reqs == 1:
            out[call.written] = attn.transpose(0, 1)
        elif call.real is None:
            out[call.written] = attn.squeeze(2)
        else:
            out[call.written] = attn.transpose(1, 2)[call.real]
