"""config.json read with `json` (no transformers import) gives the same ModelSpec, architecture class and
quantization as transformers' AutoConfig, for every preset and every kind of checkpoint the tests write; a
config that leaves a field to transformers' class defaults is read through AutoConfig instead."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from kiln.models.base import ModelSpec
from kiln.models.loader.config_view import ConfigView, json_config_view
from kiln.models.loader.load import resolve_model_source
from kiln.models.loader.presets import PRESETS, preset_config, preset_view
from kiln.models.quant.config import resolve_quantization
from kiln.models.registry import model_class

TINY_KINDS = ("tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral")


def _transformers_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_view_gives_the_transformers_spec(preset: str) -> None:
    view, hf = preset_view(preset), preset_config(preset)
    assert ModelSpec.from_hf(view) == ModelSpec.from_hf(hf)
    assert model_class(view) is model_class(hf)
    assert resolve_model_source(preset) == (None, view)


@pytest.mark.parametrize("preset", TINY_KINDS)
def test_checkpoint_view_gives_the_transformers_spec(preset: str, tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint(preset)
    model_dir, config = resolve_model_source(str(path))
    assert model_dir == path and isinstance(config, ConfigView)  # the fast path, not the fallback
    hf = _transformers_config(path)
    assert ModelSpec.from_hf(config) == ModelSpec.from_hf(hf)
    assert model_class(config) is model_class(hf)
    for option in (None, "fp8"):
        assert resolve_quantization(option, config) == resolve_quantization(option, hf)


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-8b", "smollm2-135m"])
def test_random_checkpoint_view_gives_the_transformers_spec(preset: str, tmp_path: Path) -> None:
    # the benchmark's on-disk checkpoints (config written by transformers with dtype set), weights not needed
    config = preset_config(preset)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp_path)
    view, reason = json_config_view(tmp_path)
    assert reason is None
    assert ModelSpec.from_hf(view) == ModelSpec.from_hf(_transformers_config(tmp_path))


def test_embedded_model_view_gives_the_transformers_spec(embedded_dir: Path) -> None:
    model_dir, config = resolve_model_source(None)
    assert model_dir == embedded_dir and isinstance(config, ConfigView)
    assert ModelSpec.from_hf(config) == ModelSpec.from_hf(_transformers_config(embedded_dir))


def test_fp8_checkpoint_config_resolves_the_same_scheme(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("tiny-llama")
    values = json.loads((path / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (tmp_path / "config.json").write_text(json.dumps(values))
    view, _ = json_config_view(tmp_path)
    scheme = resolve_quantization(None, view)
    assert scheme is not None and scheme == resolve_quantization(None, _transformers_config(tmp_path))


@pytest.mark.parametrize(("preset", "field"), [("tiny-qwen2", "num_key_value_heads"), ("tiny-llama", "eos_token_id"),
                                               ("tiny-qwen3", "head_dim"), ("tiny-llama", "tie_word_embeddings")])
def test_config_missing_a_defaulted_field_falls_back_to_transformers(preset: str, field: str, tiny_checkpoint,
                                                                     tmp_path: Path) -> None:
    path, _ = tiny_checkpoint(preset)
    values = json.loads((path / "config.json").read_text())
    assert field in values
    del values[field]
    (tmp_path / "config.json").write_text(json.dumps(values))
    _, config = resolve_model_source(str(tmp_path))
    assert not isinstance(config, ConfigView)  # read by transformers, class defaults included
    assert ModelSpec.from_hf(config) == ModelSpec.from_hf(_transformers_config(tmp_path))
    if field == "num_key_value_heads":  # the class default (not = num_heads, as the JSON alone would say)
        assert ModelSpec.from_hf(config).num_kv_heads == _transformers_config(tmp_path).num_key_value_heads


def test_legacy_rope_scaling_falls_back_to_transformers(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("tiny-llama")
    values = json.loads((path / "config.json").read_text())
    values.pop("rope_parameters", None)
    values.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(values))
    _, config = resolve_model_source(str(tmp_path))
    assert not isinstance(config, ConfigView)
    assert ModelSpec.from_hf(config) == ModelSpec.from_hf(_transformers_config(tmp_path))


def test_view_is_read_only_and_pickles() -> None:
    view = preset_view("tiny-llama")
    with pytest.raises(AttributeError):
        view.hidden_size = 1
    with pytest.raises(AttributeError):
        _ = view.no_such_field
    assert getattr(view, "head_dim", None) is None and view.hidden_size == PRESETS["tiny-llama"]["hidden_size"]
    assert pickle.loads(pickle.dumps(view)) == view


def test_config_view_load_does_not_import_transformers(tiny_checkpoint, tmp_path: Path) -> None:
    import subprocess
    import sys

    path, _ = tiny_checkpoint("tiny-llama")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    code = ("import sys; from kiln.models.loader.load import resolve_model_source; "
            f"resolve_model_source({str(tmp_path)!r}); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_hub_layout_llama3_config_gives_the_transformers_spec(tmp_path: Path) -> None:
    # as Llama-3.1 checkpoints publish it (transformers 4 layout): rope_theta at the top, rope_scaling, torch_dtype
    values = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "attention_bias": False, "bos_token_id": 128000,
              "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    (tmp_path / "config.json").write_text(json.dumps(values))
    _, config = resolve_model_source(str(tmp_path))
    assert isinstance(config, ConfigView)
    assert ModelSpec.from_hf(config) == ModelSpec.from_hf(_transformers_config(tmp_path))
