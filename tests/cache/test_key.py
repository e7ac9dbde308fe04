"""The compile-cache key: what changes it, and what must not (paths, unrelated environment, weights)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from kiln.cache.key import KILN_ROOT, TRACED_PACKAGES, cache_key, key_factors
from kiln.config import CompilationConfig
from kiln.models.base import ModelSpec
from kiln.models.loader.presets import preset_config


def spec_of(preset: str = "tiny-llama") -> ModelSpec:
    return ModelSpec.from_hf(preset_config(preset))


BASE = dict(dtype=torch.float32, max_num_tokens=32, device="cpu", attention_backend="torch", pass_uuid="p0")


def key(**overrides) -> str:
    kwargs = {"spec": spec_of(), "compilation": CompilationConfig(level=1).resolve(torch.device("cpu"), 32),
              **BASE, **overrides}
    return cache_key(key_factors(**kwargs))


def test_same_config_same_key() -> None:
    assert key() == key()


@pytest.mark.parametrize("override", [
    {"dtype": torch.bfloat16},
    {"compilation": CompilationConfig(level=2).resolve(torch.device("cpu"), 32)},
    {"compilation": CompilationConfig(level=1, compile_sizes=(4,)).resolve(torch.device("cpu"), 32)},
    {"compilation": CompilationConfig(level=1, compile_ranges=(8,)).resolve(torch.device("cpu"), 32)},
    {"compilation": CompilationConfig(level=1, enable_passes=True).resolve(torch.device("cpu"), 32)},
    {"spec": dataclasses.replace(spec_of(), num_layers=3)},
    {"spec": spec_of("tiny-llama3")},
    {"pass_uuid": "p1"},
    {"max_num_tokens": 64},
    {"attention_backend": "other"},
], ids=["dtype", "level", "compile_sizes", "compile_ranges", "passes_on", "num_layers", "model_config",
        "pass_set", "max_tokens", "attention_backend"])
def test_each_factor_changes_the_key(override: dict) -> None:
    assert key(**override) != key()


def test_traced_source_changes_the_key(tmp_path: Path) -> None:
    for package in TRACED_PACKAGES:
        shutil.copytree(KILN_ROOT / package, tmp_path / package)
    assert key(source_root=tmp_path) == key()  # contents, not the location, are hashed
    layers = tmp_path / "models" / "layers.py"
    layers.write_text(layers.read_text() + "\n# a change Dynamo would trace\n")
    assert key(source_root=tmp_path) != key()


def test_paths_and_unrelated_env_do_not_change_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = key(compilation=CompilationConfig(level=1).resolve(torch.device("cpu"), 32))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "1")
    dumped = CompilationConfig(level=1, debug_dump_path=str(tmp_path / "dump")).resolve(torch.device("cpu"), 32)
    assert key(compilation=dumped) == before
    assert key() == before
