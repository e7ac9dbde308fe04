"""The per-forward context that carries batch metadata to the attention op.

Batch metadata (block tables, sequence lengths, slot mapping) is not a graph input: the model runner
sets it here for the duration of one forward, and `kiln::attention` reads it. This keeps the compiled
graphs free of metadata tensors, so one trace serves every batch composition.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class AttentionFn(Protocol):
    """k and v None: this step's keys/values are already in the cache (only with cache_only_attention)."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 out: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Rope:
    """A rotation still to apply to q and k (neox halves, the rotary dim the head dim), after a per-head RMSNorm of
    each when the weights are given (Qwen3): what kiln::rope_attention hands a backend that rotates inside its
    attention kernel."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0


class RopeAttentionFn(Protocol):
    """`AttentionFn` on q/k before `rope`; False (nothing done) where the step's kernel cannot rotate them."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 rope: Rope) -> bool: ...


@dataclass
class ForwardContext:
    attention: AttentionFn  # bound to the backend, this step's metadata and the KV cache
    metadata: Any = None  # the backend's metadata, for inspection (tests, graph wrappers)
    num_tokens: int = 0  # tokens in the (possibly padded) batch
    # For fused ops that write K/V themselves (kiln/passes rope_kv): every layer's paged cache
    # [num_layers, num_blocks, 2, block_size, Hkv, D], this step's slot mapping, and whether `attention`
    # accepts k = v = None. Left unset, those ops take the plain path through `attention`.
    kv_caches: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    cache_only_attention: bool = False
    # set where the backend can rotate q/k inside its kernel (`supports_rope`): kiln::rope_attention tries it first
    rope_attention: RopeAttentionFn | None = None
    # per layer (k_scale, v_scale) of an fp8 cache (kiln/models/kv_quant.py); None: every scale is 1.0
    kv_scales: tuple[tuple[float, float], ...] | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError(
            "kiln::attention was called outside a forward context; run the model through the ModelRunner "
            "(or wrap the call in kiln.models.forward_context.set_forward_context)"
        )
    return _current


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous
