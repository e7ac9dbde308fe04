"""The KV-sizing profiling forward runs at the full token budget, even where that budget exceeds the model's
context (tiny-llama: 512 positions, 1100 tokens here): it must not ask for a position the model lacks."""

from __future__ import annotations

import torch

from kiln.attention.base import AttentionLayout
from kiln.models.loader.load import load_model
from kiln.runtime.kv.profile import profile_activation_peak, profiling_batch


def test_profiling_batch_splits_the_budget_into_sequences_within_the_context() -> None:
    lens, positions = profiling_batch(1100, 512)
    assert lens == [512, 512, 76]
    assert positions.numel() == 1100 and int(positions.max()) == 511
    assert positions[512:1024].tolist() == list(range(512))  # each sequence starts at position 0


def test_profiling_with_a_token_budget_beyond_max_position_embeddings() -> None:
    device = torch.device("cpu")
    loaded = load_model("tiny-llama", device=device, dtype="fp32", load_format="dummy")
    spec = loaded.spec
    assert spec.max_position_embeddings == 512
    layout = AttentionLayout(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim ** -0.5, 16,
                             loaded.dtype)
    # the positions of one 1100-token sequence would index past the rotary table (an IndexError on CPU)
    assert profile_activation_peak(loaded.model, device, 1100, layout, spec.max_position_embeddings) == 0
