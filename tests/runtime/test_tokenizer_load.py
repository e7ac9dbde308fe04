"""The tokenizer loads on a background thread during start-up and gives the tokenizer (or the error) that
loading it in line gives."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from kiln import Runtime
from kiln.runtime import tokenizer_load
from kiln.runtime.tokenizer_load import load_tokenizer

SMALL = dict(device="cpu", level=0, max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64)


def _word_tokenizer(directory: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # special tokens are matched anywhere in the text: named so that no word contains them
    names = {0: "<unk>", 2: "<eos>"}
    core = Tokenizer(models.WordLevel(vocab={names.get(i, f"w{i}"): i for i in range(vocab_size)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(directory))
    return directory


@pytest.fixture
def checkpoint_with_tokenizer(tiny_checkpoint, tmp_path: Path) -> Path:
    path, _ = tiny_checkpoint("tiny-llama")
    model_dir = tmp_path / "model"
    shutil.copytree(path, model_dir)
    return _word_tokenizer(model_dir, 256)


def test_tokenizer_loads_off_the_main_thread_and_matches_an_inline_load(checkpoint_with_tokenizer: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    threads = []
    original = tokenizer_load.load_tokenizer

    def recording(*args):
        threads.append(threading.current_thread())
        return original(*args)

    monkeypatch.setattr(tokenizer_load, "load_tokenizer", recording)
    rt = Runtime(str(checkpoint_with_tokenizer), **SMALL)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    inline = load_tokenizer(None, checkpoint_with_tokenizer)
    text = "w5 w17 w200 w3"
    assert rt.tokenizer(text)["input_ids"] == inline(text)["input_ids"] == [5, 17, 200, 3]
    assert rt.engine.eos_token_ids == frozenset({2})  # the tokenizer's eos joins the config's


def test_a_tokenizer_that_fails_to_load_raises_the_inline_error(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("tiny-llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(Exception) as inline:
        load_tokenizer(str(broken), None)
    with pytest.raises(Exception) as background:
        Runtime(str(path), tokenizer=str(broken), **SMALL)
    assert type(background.value) is type(inline.value)
    assert str(background.value) == str(inline.value)


def test_a_bad_model_argument_still_raises_the_loaders_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a directory with a config.json nor a preset"):
        Runtime(str(tmp_path / "nowhere"), **SMALL)


def test_nothing_but_the_tokenizer_imports_transformers_on_the_way_to_ready(checkpoint_with_tokenizer: Path) -> None:
    """In a fresh process, with the tokenizer load replaced by a stub, building the runtime from an HF
    directory never imports transformers: the tokenizer thread is its only importer on the start-up path."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from kiln.runtime import tokenizer_load\n"
            "tokenizer_load.load_tokenizer = lambda tokenizer, model_dir: None\n"
            "from kiln import Runtime\n"
            f"rt = Runtime({str(checkpoint_with_tokenizer)!r}, device='cpu', level=0, num_blocks=64)\n"
            "print(type(rt.engine.loaded.hf_config).__name__, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["ConfigView", "False"]
