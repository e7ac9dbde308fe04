"""Random weights at real shapes, produced as an HF-named checkpoint and loaded through the normal path.

Each tensor is drawn from a generator seeded by (seed, its name), so a model gets the same weights
whatever the loading order, device or tensor-parallel split.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from kiln.models.base import ModelSpec


def checkpoint_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    yield "model.embed_tokens.weight", (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", (rows, h)
            if spec.attention_bias:
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if spec.qk_norm:
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        if spec.moe is not None and i not in spec.moe.dense_layers:  # the router, then experts stacked
            e, inter = spec.moe.num_experts, spec.moe.intermediate_size
            yield p + "mlp.gate.weight", (e, h)
            yield p + "mlp.experts.gate_up_proj", (e, 2 * inter, h)
            yield p + "mlp.experts.down_proj", (e, h, inter)
            continue
        yield p + "mlp.gate_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, spec.intermediate_size)
    yield "model.norm.weight", (h,)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, h)


def dummy_weights(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Norm weights are ones; everything else N(0, 0.02), which keeps activations in a sane range."""
    for name, shape in checkpoint_shapes(spec):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
