"""The attention backend interface: what sits behind `kiln::attention`.

A backend turns the step's common metadata into its own (once per step, outside any CUDA graph) and
then, per layer, writes K/V into the paged cache and computes attention. Backends declare what they
support so the runtime can pick one and degrade the CUDA-graph mode rather than fail a batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kiln.config import GraphSupport  # re-exported: backends declare it here
from kiln.models.forward_context import Rope
from kiln.models.kv_quant import is_fp8


@dataclass
class CommonAttentionMetadata:
    """Backend-independent batch layout; device tensors are views into the runner's persistent buffers."""

    num_reqs: int
    num_tokens: int  # real (unpadded) tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: tokens in the cache after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [num_tokens (padded)] int64, device; padding points at the null block
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool  # every request has exactly one new token


@dataclass(frozen=True)
class AttentionLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_size: int
    dtype: torch.dtype  # the compute dtype: q, k, v and the output
    kv_dtype: torch.dtype | None = None  # the cache's element type; None: `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


class AttentionBackend(ABC):
    name: ClassVar[str]
    graph_support: ClassVar[GraphSupport] = GraphSupport.NEVER
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_head_dims: ClassVar[tuple[int, ...] | None] = None  # None: any
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # forward() accepts k = v = None, meaning this step's K/V are already in the cache (a fused RoPE + cache
    # write ran before it: kiln/passes/rope_kv.py), and then only reads the cache
    supports_cache_only: ClassVar[bool] = False
    # forward_rope() can take q/k before their RoPE (and q/k norms) on some steps, rotating inside its kernel
    supports_rope: ClassVar[bool] = False
    # reads and writes a float8_e4m3fn cache with per-layer scales (kiln/models/kv_quant.py)
    supports_fp8_kv: ClassVar[bool] = False
    # a captured FULL graph replays only after build_metadata ran for the step (its plan writes buffers the graph
    # reads, as FlashInfer's does); False: the graph reads nothing but the runner's input buffers, so a replay
    # skips it (tens of microseconds of the host's time on a step's critical path)
    replay_needs_metadata: ClassVar[bool] = True
    # a prefill allocates its [heads, queries, keys] scores (SDPA's math path): the KV sizing's profiling forward
    # must run this backend's attention to leave room for them; the GPU kernels allocate nothing of that order
    materializes_scores: ClassVar[bool] = False

    def __init__(self, layout: AttentionLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device

    @classmethod
    def unsupported_reason(cls, layout: AttentionLayout, device: torch.device) -> str | None:
        """None if this backend can run the layout on the device, else why not."""
        if device.type not in cls.supported_devices:
            return f"{cls.name} does not run on {device.type}"
        if layout.dtype not in cls.supported_dtypes:
            return f"{cls.name} does not support dtype {layout.dtype}"
        if cls.supported_head_dims is not None and layout.head_dim not in cls.supported_head_dims:
            return f"{cls.name} does not support head_dim {layout.head_dim}"
        if layout.cache_dtype != layout.dtype and not (is_fp8(layout.cache_dtype) and cls.supports_fp8_kv):
            return (f"{cls.name} does not support kv_cache_dtype {layout.cache_dtype} (kv_cache_dtype='fp8' runs on "
                    "the triton and torch attention backends)")
        return None

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Per-step preparation (e.g. FlashInfer plan()); runs outside CUDA graphs."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write k/v at metadata's slots in kv_cache ([num_blocks, 2, block_size, Hkv, D]) and fill out.

        k/v may be strided views (last-dim stride 1); None only where `supports_cache_only` says so.
        k_scale/v_scale: the layer's scales, used only when kv_cache is fp8 (kiln/models/kv_quant.py)."""

    def forward_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     kv_cache: torch.Tensor, metadata: Any, rope: Rope, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> bool:
        """forward() of q/k before `rope`, rotated inside the attention kernel; False, having done nothing, where
        this step's kernel cannot (the caller rotates and calls forward())."""
        return False
