"""Attention backends behind `kiln::attention`, and the selection among them."""

from __future__ import annotations

import torch

from kiln.attention.base import AttentionBackend, AttentionLayout, GraphSupport
from kiln.attention.torch_backend import TorchAttentionBackend

# Preference order for `auto` on CUDA; GPU backends register themselves lazily (optional deps). Triton
# first: it won the decode A/B at every batch and context and the end-to-end decode (docs/attention.md), and
# runs every layout FlashInfer does, so FlashInfer serves when chosen by name (`attention_backend="flashinfer"`).
_BACKENDS: dict[str, str] = {
    "triton": "kiln.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "kiln.attention.flashinfer_backend:FlashInferAttentionBackend",
    "torch": "kiln.attention.torch_backend:TorchAttentionBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    import importlib

    module, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def select_backend(name: str, layout: AttentionLayout, device: torch.device) -> type[AttentionBackend]:
    """`auto`: the first backend that loads and supports the layout (torch only on CPU)."""
    if name != "auto":
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(_BACKENDS)}")
        try:
            cls = _load(name)
        except ImportError as e:  # an optional dependency (flashinfer, triton) is missing
            raise ValueError(f"attention backend {name!r} needs {e.name or e}: pip install 'kiln[gpu]'") from e
        reason = cls.unsupported_reason(layout, device)
        if reason:
            raise ValueError(f"attention backend {name!r} cannot run this model: {reason}")
        return cls
    candidates = list(_BACKENDS) if device.type == "cuda" else ["torch"]
    for candidate in candidates:
        try:
            cls = _load(candidate)
        except ImportError:
            continue
        if cls.unsupported_reason(layout, device) is None:
            return cls
    return TorchAttentionBackend


__all__ = ["AttentionBackend", "AttentionLayout", "GraphSupport", "TorchAttentionBackend", "select_backend"]
