"""The KV-sizing profiling forward runs at the full token budget, even where that budget exceeds the model's
context (tiny-llama: 512 positions, 1100 tokens here): it must not ask for a position the model lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.attention import torch_backend
from kiln.attention.base import AttentionLayout
from kiln.models.loader.load import LoadedModel, load_model
from kiln.runtime.kv.profile import profile_activation_peak, profiling_batch


def test_profiling_batch_splits_the_budget_into_sequences_within_the_context() -> None:
    lens, positions = profiling_batch(1100, 512)
    assert lens == [512, 512, 76]
    assert positions.numel() == 1100 and int(positions.max()) == 511
    assert positions[512:1024].tolist() == list(range(512))  # each sequence starts at position 0


def tiny_llama() -> tuple[LoadedModel, AttentionLayout]:
    loaded = load_model("tiny-llama", device=torch.device("cpu"), dtype="fp32", load_format="dummy")
    spec = loaded.spec
    return loaded, AttentionLayout(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim ** -0.5, 16,
                                   loaded.dtype)


def test_profiling_with_a_token_budget_beyond_max_position_embeddings() -> None:
    loaded, layout = tiny_llama()
    spec, device = loaded.spec, torch.device("cpu")
    assert spec.max_position_embeddings == 512
    # the positions of one 1100-token sequence would index past the rotary table (an IndexError on CPU)
    assert profile_activation_peak(loaded.model, device, 1100, layout, spec.max_position_embeddings) == 0


@pytest.mark.parametrize("run_attention", [False, True])
def test_the_profile_holds_no_attention_scores_unless_the_backend_materializes_them(
        run_attention: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU backends' kernels allocate nothing of a prefill's [heads, queries, keys] order, so the profile
    must not either (the torch reference's scores, on CUDA's math path for a masked grouped-KV call, had taken
    the KV cache's room); for the torch backend, which does, the profile runs its attention at full length."""
    loaded, layout = tiny_llama()
    spec = loaded.spec
    scores: list[int] = []  # per SDPA call, the elements of the scores the math path holds
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object) -> torch.Tensor:
        scores.append(query.shape[-3] * query.shape[-2] * key.shape[-2])
        return real_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", sdpa)
    tokens = spec.max_position_embeddings  # one sequence
    profile_activation_peak(loaded.model, torch.device("cpu"), tokens, layout, tokens, run_attention=run_attention)
    expected = [spec.num_heads * tokens * tokens] * spec.num_layers if run_attention else []
    assert scores == expected
