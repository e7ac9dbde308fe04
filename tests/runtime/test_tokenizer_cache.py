"""The tokenizer pickled under the cache root (kiln/runtime/tokenizer_cache.py): a second load of the embedded model's
tokenizer does not run AutoTokenizer and gives the same encodings, decodings, chat prompt and special tokens; any
change to the directory's files loads it again; a damaged pickle is replaced; the cache switch and `kiln cache
clear` apply to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import transformers

from kiln.cache.store import TOKENIZER_DIR
from kiln.runtime.tokenizer_load import load_tokenizer

TEXTS = ["What is the capital of France?", "  spaces,\ttabs and ünïcödé 😀\n", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def model_dir(embedded_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The embedded model's tokenizer and config files (no weights) in a directory of the test's own."""
    directory = tmp_path / "model"
    directory.mkdir()
    for path in embedded_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, directory / path.name)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    return directory


@pytest.fixture
def auto_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of AutoTokenizer.from_pretrained."""
    calls: list[str] = []
    original = transformers.AutoTokenizer.from_pretrained

    def recording(source: str, *args, **kwargs):
        calls.append(source)
        return original(source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    return calls


def behaviour(tokenizer) -> tuple:
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    return (type(tokenizer).__name__, ids, [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
            tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
            tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.all_special_ids,
            len(tokenizer), tokenizer.model_max_length)


def pickles(model_dir: Path) -> list[Path]:
    return sorted((model_dir.parent / "cache" / TOKENIZER_DIR).glob("*.pkl"))


def test_a_second_load_is_unpickled_and_behaves_the_same(model_dir: Path, auto_loads: list[str]) -> None:
    fresh = load_tokenizer(None, model_dir)
    assert len(auto_loads) == 1 and len(pickles(model_dir)) == 1
    cached = load_tokenizer(None, model_dir)
    assert len(auto_loads) == 1  # no AutoTokenizer this time
    assert cached is not fresh and behaviour(cached) == behaviour(fresh)
    assert "What is 2+2?" in behaviour(cached)[3]  # the chat template rendered the messages

    from kiln.entrypoints.cli.main import main

    assert main(["cache", "clear"]) == 0 and pickles(model_dir) == []


def test_a_changed_file_or_a_damaged_pickle_loads_it_again(model_dir: Path, auto_loads: list[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    load_tokenizer(None, model_dir)
    config = model_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 8192', '"model_max_length": 4096'))
    assert load_tokenizer(None, model_dir).model_max_length == 4096 and len(auto_loads) == 2
    assert len(pickles(model_dir)) == 2  # one per content
    newest = max(pickles(model_dir), key=lambda p: p.stat().st_mtime_ns)
    newest.write_bytes(b"not a pickle")
    assert load_tokenizer(None, model_dir).model_max_length == 4096 and len(auto_loads) == 3
    assert "discarding cached tokenizer" in caplog.text
    assert load_tokenizer(None, model_dir).model_max_length == 4096 and len(auto_loads) == 3  # rewritten


def test_the_cache_switch_turns_it_off(model_dir: Path, auto_loads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    for _ in range(2):
        load_tokenizer(None, model_dir)
    assert len(auto_loads) == 2 and pickles(model_dir) == []
