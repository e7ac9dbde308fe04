"""The profiling forward's activation peak is remembered per key: a second start with the same model, budget,
layout and code reads it instead of running the forward; anything that changes the forward's allocations
misses; a broken file is measured again; the cache switch and `kiln cache clear` cover it."""

from __future__ import annotations

import pytest
import torch

from kiln.attention.base import AttentionLayout
from kiln.models.loader.load import load_model
from kiln.runtime.kv import peak_cache

DEVICE = torch.device("cpu")


@pytest.fixture
def profiled(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """The cache under tmp_path; the profiling forward replaced by one that records its token budget and
    returns a peak derived from it (on the CPU the real one measures 0)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    calls: list[int] = []

    def fake_profile(model, device, num_tokens, layout, max_model_len, run_attention) -> int:
        calls.append(num_tokens)
        return 1000 * num_tokens + max_model_len

    monkeypatch.setattr(peak_cache, "profile_activation_peak", fake_profile)
    return calls


def model_and_layout(name: str = "tiny-llama") -> tuple[torch.nn.Module, AttentionLayout]:
    loaded = load_model(name, device=DEVICE, dtype="fp32", load_format="dummy")
    spec = loaded.spec
    return loaded.model, AttentionLayout(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim ** -0.5,
                                         16, loaded.dtype)


def test_a_second_start_reads_the_peak_instead_of_profiling(profiled: list[int]) -> None:
    model, layout = model_and_layout()
    assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, False)
    assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, True)
    assert profiled == [256]


def test_what_changes_the_forward_misses(profiled: list[int]) -> None:
    model, layout = model_and_layout()
    peak_cache.activation_peak(model, DEVICE, 256, layout, 512)
    peak_cache.activation_peak(model, DEVICE, 128, layout, 512)  # another token budget
    peak_cache.activation_peak(model, DEVICE, 256, layout, 256)  # another split of the budget
    fp8_cache = AttentionLayout(layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.scale,
                                layout.block_size, layout.dtype, torch.float8_e4m3fn)
    peak_cache.activation_peak(model, DEVICE, 256, fp8_cache, 512)
    peak_cache.activation_peak(model, DEVICE, 256, layout, 512, run_attention=True)  # the torch backend's scores
    assert len(profiled) == 5
    # other tensors (here a half-width MLP: what a tensor-parallel shard or another checkpoint would change)
    other, _ = model_and_layout()
    first_mlp = next(m for name, m in other.named_modules() if name.endswith("down_proj"))
    first_mlp.weight = torch.nn.Parameter(first_mlp.weight[:, : first_mlp.weight.shape[1] // 2])
    assert peak_cache.activation_peak(other, DEVICE, 256, layout, 512) == (256_512, False)
    assert len(profiled) == 6


def test_an_unreadable_peak_is_measured_again(profiled: list[int]) -> None:
    model, layout = model_and_layout()
    peak_cache.activation_peak(model, DEVICE, 256, layout, 512)
    path = peak_cache.peak_path(peak_cache.peak_key(model, DEVICE, 256, layout, 512))
    for broken in ("{not json", '{"peak_bytes": -5}', '{"other": 1}'):
        path.write_text(broken)
        assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, False)
    assert len(profiled) == 4
    assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, True)  # rewritten


def test_the_cache_switch_turns_it_off(profiled: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    model, layout = model_and_layout()
    for _ in range(2):
        assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, False)
    assert len(profiled) == 2
    assert not (peak_cache.cache_root() / peak_cache.PEAK_DIR).exists()


def test_cache_clear_removes_the_peaks(profiled: list[int]) -> None:
    from kiln.entrypoints.cli.main import main

    model, layout = model_and_layout()
    peak_cache.activation_peak(model, DEVICE, 256, layout, 512)
    assert main(["cache", "clear"]) == 0
    assert peak_cache.activation_peak(model, DEVICE, 256, layout, 512) == (256_512, False)
    assert len(profiled) == 2
