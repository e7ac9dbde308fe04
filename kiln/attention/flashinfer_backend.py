"""FlashInfer (0.6.x) backend: paged prefill and tensor-core decode over kiln's KV cache, no copies.

kiln's per-layer cache [num_blocks, 2, block_size, Hkv, D] is exactly FlashInfer's single-tensor "NHD"
paged layout, so the wrappers read it in place; the KV write is our Triton reshape-and-cache kernel
(graph-safe and layout-agnostic). plan() runs once per step in build_metadata, outside any graph, on
host-side lengths only; page indices are flattened on device by a Triton kernel, so nothing syncs.

Uniform-decode steps use a BatchDecodeWithPagedKVCacheWrapper per request count, created with
use_cuda_graph=True over persistent buffers: a graph captured for that count replays against whatever
the next plan() wrote there. Everything else (prefill, chunks, mixed batches) uses one paged prefill
wrapper, eagerly: GraphSupport.UNIFORM_DECODE. Decode uses tensor cores (the FA2 prefill kernel with
one query row per request), which is faster for GQA and shares its JIT module with prefill, so one
module is compiled per (dtype, head_dim).

kv_cache_dtype='fp8' is refused (supports_fp8_kv False, so `auto` falls through to Triton): FlashInfer reads
e4m3 caches, but kiln has not yet validated its fp8 plan/run path (a q/kv dtype pair is a separate JIT module,
and the scales go to run()) against the torch reference on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import flashinfer
import torch

from kiln.attention.base import AttentionBackend, AttentionLayout, CommonAttentionMetadata, GraphSupport
from kiln.attention.triton_backend import build_page_indices, reshape_and_cache

_FLOAT_WORKSPACE_BYTES = 128 << 20  # split-KV partials; FlashInfer's recommended size
_INT_WORKSPACE_BYTES = 8 << 20  # plan info; the size FlashInfer's wrappers allocate themselves


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    wrapper: Any  # the wrapper planned for this step
    num_rows: int  # query rows it was planned for: real tokens (prefill) or requests (decode)


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    graph_support = GraphSupport.UNIFORM_DECODE
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_dims = (64, 128, 256)
    supported_devices = ("cuda",)
    supports_cache_only = True  # k = v = None: a fused RoPE + cache write (kiln/passes/rope_kv.py) ran first

    @classmethod
    def unsupported_reason(cls, layout: AttentionLayout, device: torch.device) -> str | None:
        reason = super().unsupported_reason(layout, device)
        if reason is None and layout.num_heads % layout.num_kv_heads:
            reason = "num_heads must be a multiple of num_kv_heads"
        return reason

    def __init__(self, layout: AttentionLayout, device: torch.device) -> None:
        super().__init__(layout, device)
        self._float_ws = torch.zeros(_FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._int_ws = torch.zeros(_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._pinned_ws = torch.zeros(_INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        # fa2 by default: it is the module tensor-core decode needs anyway (one JIT build, not two)
        prefill_backend = os.environ.get("KILN_FLASHINFER_PREFILL_BACKEND", "fa2")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._float_ws, "NHD",
                                                                       backend=prefill_backend)
        self._share_workspace(self._prefill)
        self._decode: dict[int, tuple[Any, int]] = {}  # num_reqs -> (graph-mode wrapper, page capacity)
        # Flattened page indices, grown outside graphs; retired buffers stay alive for captured graphs.
        self._indices = torch.zeros(0, dtype=torch.int32, device=device)
        self._retired: list[torch.Tensor] = []
        self._warmup()

    def _warmup(self) -> None:
        """Plan a one-token batch so FlashInfer JIT-builds (or loads) its module at start-up, not mid-serving."""
        self._ensure_indices(1)
        one, indptr = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        layout = self.layout
        self._prefill.plan(indptr, indptr, self._indices[:1], one, layout.num_heads, layout.num_kv_heads,
                           layout.head_dim, layout.block_size, causal=True, q_data_type=layout.dtype,
                           kv_data_type=layout.dtype, sm_scale=layout.scale)

    def _share_workspace(self, wrapper: Any) -> None:
        # One int workspace for every wrapper: only one wrapper is planned per step, and plan() rewrites
        # the workspace before each run or graph replay. Saves 8 MiB of device + pinned memory per
        # captured batch size. (Private attributes: pinned to flashinfer-python < 0.7.)
        wrapper._int_workspace_buffer = self._int_ws
        wrapper._pin_memory_int_workspace_buffer = self._pinned_ws

    def _ensure_indices(self, capacity: int) -> None:
        if self._indices.numel() < capacity:
            self._retired.append(self._indices)
            self._indices = torch.zeros(max(capacity, 2 * self._indices.numel()), dtype=torch.int32,
                                        device=self.device)

    def _decode_wrapper(self, num_reqs: int, total_pages: int, max_pages: int) -> Any:
        entry = self._decode.get(num_reqs)
        if entry is None or entry[1] < total_pages:
            # size the indices for the longest possible requests, so a captured graph never outgrows them
            capacity = max(num_reqs * max_pages, total_pages)
            self._ensure_indices(capacity)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._float_ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(num_reqs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=torch.zeros(num_reqs, dtype=torch.int32, device=self.device))
            self._share_workspace(wrapper)
            entry = self._decode[num_reqs] = (wrapper, self._indices.numel())
        return entry[0]

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        layout, bs, n = self.layout, self.layout.block_size, common.num_reqs
        seq_lens = common.seq_lens_cpu.to(torch.int32)
        pages = (seq_lens + bs - 1) // bs
        indptr = torch.zeros(n + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=indptr[1:])
        last_page_len = seq_lens - (pages - 1).clamp(min=0) * bs
        total_pages = int(indptr[-1])
        plan_args = dict(q_data_type=layout.dtype, kv_data_type=layout.dtype, sm_scale=layout.scale,
                         non_blocking=True)
        if common.uniform_decode:
            wrapper = self._decode_wrapper(n, total_pages, common.block_tables.shape[1])
        else:
            wrapper = self._prefill
            self._ensure_indices(total_pages)
        build_page_indices(common.block_tables, common.seq_lens, self._indices, bs)
        indices = self._indices[:total_pages]
        if common.uniform_decode:
            wrapper.plan(indptr, indices, last_page_len, layout.num_heads, layout.num_kv_heads, layout.head_dim,
                         bs, **plan_args)
            return FlashInferMetadata(common, wrapper, n)
        wrapper.plan(common.query_start_loc_cpu, indptr, indices, last_page_len, layout.num_heads,
                     layout.num_kv_heads, layout.head_dim, bs, causal=True, **plan_args)
        return FlashInferMetadata(common, wrapper, common.num_tokens)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: FlashInferMetadata, k_scale: float = 1.0,
                v_scale: float = 1.0) -> None:  # the scales only apply to an fp8 cache, which is refused
        if k is not None and v is not None:
            reshape_and_cache(k, v, kv_cache, metadata.common.slot_mapping)
        rows = metadata.num_rows
        if rows == 0:
            return
        if not q.is_contiguous():
            q = q.contiguous()
        metadata.wrapper.run(q[:rows], kv_cache, out=out[:rows])
