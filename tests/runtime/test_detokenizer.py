"""IncrementalDetokenizer against real tokenizers built locally: byte-level BPE and sentencepiece-style."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from kiln.runtime.detokenizer import IncrementalDetokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, café au lait et crème brûlée",
    "日本語のテキストを少し書きます",
    "smile 🙂 and smile again 🙂🙂",
    "STOP here. Stop there; stopping everywhere!",
]
# Words outside the corpus as well, so some characters are split into byte-level / byte-fallback tokens.
WORDS = ["the", "fox", "héllo", "wörld", "café", "日本語", "テキスト", "🙂", "smile", "STOP", "stop", "龍",
         "🦀", "straße", "€5", "naïve", "ğ", "a", "!", ",", "\n", "  ", "데이터", "👩‍💻"]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary: common words merge, rarer multi-byte characters stay split over byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-style: '▁' marks word starts, unknown characters fall back to <0xNN> byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS * 20, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerBase]] = {
    "byte_level": _byte_level_tokenizer,
    "sentencepiece": _sentencepiece_tokenizer,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return TOKENIZERS[request.param]()


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerBase:
    return _byte_level_tokenizer()


def _decode(tok: PreTrainedTokenizerBase, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _random_text(rng: random.Random, special: str) -> str:
    parts = [rng.choice(WORDS) if rng.random() > 0.05 else special for _ in range(rng.randint(1, 25))]
    return "".join(p + rng.choice([" ", " ", ""]) for p in parts)


def _expected_output(tok: PreTrainedTokenizerBase, prompt: list[int], out: list[int], skip: bool) -> str:
    """The output's text as it reads after the prompt (a sentencepiece leading space is kept)."""
    prompt_text = _decode(tok, prompt, skip)
    full = _decode(tok, prompt + out, skip)
    if prompt_text.endswith("\ufffd") or not full.startswith(prompt_text):
        return _decode(tok, out, skip)  # prompt cut inside a character: the output stands alone
    return full[len(prompt_text):]


def _chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def _stream(det: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = []
    for chunk in chunks:
        if det.update(chunk) is not None:
            break
        deltas.append(det.take_delta())
    deltas.append(det.take_delta(finished=True))
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_stream_matches_full_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    rng = random.Random(1234)
    special = tokenizer.eos_token
    split_chars = 0
    for _ in range(300):
        ids = tokenizer.encode(_random_text(rng, special), add_special_tokens=False)
        cut = rng.randint(0, len(ids))  # may split a character between prompt and output
        prompt, out = ids[:cut], ids[cut:]
        split_chars += sum(_decode(tokenizer, [t]).endswith("\ufffd") for t in out)
        det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        deltas = _stream(det, _chunks(rng, out))
        expected = _expected_output(tokenizer, prompt, out, skip)
        assert "".join(deltas) == det.output_text == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas), deltas
        if not skip and tokenizer.eos_token_id in out:
            assert special in expected
    assert split_chars > 50, "the corpus should split multi-byte characters over tokens"


def test_byte_level_output_equals_plain_decode(byte_tok: PreTrainedTokenizerBase) -> None:
    rng = random.Random(7)
    for _ in range(100):
        prompt = byte_tok.encode(_random_text(rng, ""))
        out = byte_tok.encode(_random_text(rng, "<|endoftext|>"))
        det = IncrementalDetokenizer(byte_tok, prompt)
        assert "".join(_stream(det, _chunks(rng, out))) == _decode(byte_tok, out)


def test_incomplete_character_waits(byte_tok: PreTrainedTokenizerBase) -> None:
    ids = byte_tok.encode("ab 🦀")
    pieces = [_decode(byte_tok, [t]) for t in ids]
    assert sum(p == "\ufffd" for p in pieces) >= 2, pieces  # the crab is split over byte tokens
    det = IncrementalDetokenizer(byte_tok, [])
    deltas = []
    for t in ids:
        det.update([t])
        deltas.append(det.take_delta())
    assert "".join(deltas) == "ab 🦀"
    assert deltas[-1].endswith("🦀") and not any("\ufffd" in d for d in deltas)

    # A request that ends mid-character still flushes what the tokens decode to.
    det = IncrementalDetokenizer(byte_tok, [])
    det.update(ids[:-1])
    assert det.take_delta() == "ab "
    assert det.output_text.startswith("ab \ufffd")
    assert det.take_delta(finished=True) == det.output_text[3:] == _decode(byte_tok, ids[:-1])[3:]


def test_sentencepiece_leading_space_kept_after_prompt() -> None:
    tok = _sentencepiece_tokenizer()
    ids = tok.encode("the fox jumps over the lazy dog", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[2]).startswith("▁")
    det = IncrementalDetokenizer(tok, ids[:2])
    for t in ids[2:]:
        det.update([t])
    assert det.take_delta(finished=True) == " jumps over the lazy dog"
    # Without a prompt the output is a text of its own: no leading space, as tokenizer.decode gives.
    det = IncrementalDetokenizer(tok, [])
    det.update(ids[2:])
    assert det.take_delta(finished=True) == "jumps over the lazy dog"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(byte_tok: PreTrainedTokenizerBase, include: bool) -> None:
    text = "the quick brown fox 日本語 🦀 jumps over"
    stop = "fox 日本語 🦀 ju"
    ids = byte_tok.encode(text)
    assert not any(stop in _decode(byte_tok, [t]) for t in ids)  # the stop spans several tokens
    det = IncrementalDetokenizer(byte_tok, [], stop=("never", stop), include_stop_str_in_output=include)
    streamed, fired_at = "", None
    for n, t in enumerate(ids):
        hit = det.update([t])
        streamed += det.take_delta()
        if hit is not None:
            fired_at = n
            break
        assert "fox" not in streamed  # held back while it could still become the stop string
    assert hit == stop == det.stop_str
    # It fires at the first token whose text completes the stop string, not later.
    assert stop in _decode(byte_tok, ids[:fired_at + 1]) and stop not in _decode(byte_tok, ids[:fired_at])
    idx = text.index(stop)
    expected = text[:idx + len(stop)] if include else text[:idx]
    assert det.output_text == expected
    assert det.update(byte_tok.encode(" more")) is None and det.output_text == expected
    assert streamed + det.take_delta(finished=True) == expected


def test_stop_prefix_released_when_it_diverges(byte_tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(byte_tok, [], stop=("STOP!",))
    det.update(byte_tok.encode("go ST"))
    assert det.take_delta() == "go "
    det.update(byte_tok.encode("OP"))
    assert det.take_delta() == ""
    det.update(byte_tok.encode("?"))
    assert det.take_delta() == "STOP?"
    assert det.take_delta(finished=True) == ""


def test_earliest_stop_wins_within_one_update(byte_tok: PreTrainedTokenizerBase) -> None:
    stops = ("lazy", "fox", "fox jumps")
    det = IncrementalDetokenizer(byte_tok, [], stop=stops, include_stop_str_in_output=True)
    assert det.update(byte_tok.encode("the quick brown fox jumps over the lazy dog")) == "fox jumps"
    assert det.take_delta() == det.output_text == "the quick brown fox jumps"


@pytest.mark.parametrize("include", [False, True])
def test_random_stops_never_leak(byte_tok: PreTrainedTokenizerBase, include: bool) -> None:
    rng = random.Random(99)
    fired = 0
    for _ in range(300):
        out = byte_tok.encode(_random_text(rng, "<|endoftext|>"))
        full = _decode(byte_tok, out)
        stops = ["xyzzy", "smile 🙂 and"]  # decoys whose prefixes occur but which never match
        if len(full) > 3:
            i = rng.randrange(len(full) - 2)
            stops.append(full[i:i + rng.randint(2, 8)].strip("\ufffd") or "q")
        chunks = _chunks(rng, out)

        # Reference: the first chunk boundary whose (complete-character) text contains a stop string.
        expected, ref_stop, n = full, None, 0
        for chunk in chunks:
            n += len(chunk)
            text = _decode(byte_tok, out[:n]).rstrip("\ufffd")
            hits = [(text.index(s), -len(s), s) for s in stops if s in text]
            if hits:
                i, _, ref_stop = min(hits)
                expected = text[:i + len(ref_stop)] if include else text[:i]
                break

        det = IncrementalDetokenizer(byte_tok, [], stop=tuple(stops), include_stop_str_in_output=include)
        streamed = ""
        for chunk in chunks:
            hit = det.update(chunk)
            if hit is None:
                streamed += det.take_delta()
                assert not any(s in streamed for s in stops)
                if ref_stop is not None:  # nothing from where the stop string starts may have been sent
                    assert len(streamed) <= len(expected) - (len(ref_stop) if include else 0)
            else:
                break
        assert hit == ref_stop
        fired += hit is not None
        assert streamed + det.take_delta(finished=True) == det.output_text == expected

        # Not streamed: the text is only taken at the end.
        det = IncrementalDetokenizer(byte_tok, [], stop=tuple(stops), include_stop_str_in_output=include)
        for chunk in chunks:
            if det.update(chunk) is not None:
                break
        assert det.take_delta(finished=True) == expected
    assert fired > 100


class RecordingTokenizer:
    """Decodes with `tok`, recording the length of every id list it is asked to decode."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok, self.all_special_ids, self.lengths = tok, tok.all_special_ids, []

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_window_stays_small(byte_tok: PreTrainedTokenizerBase) -> None:
    """Per-token cost must not grow with the output: every decode call sees only a few tokens."""
    recording = RecordingTokenizer(byte_tok)
    lengths = recording.lengths
    rng = random.Random(3)
    out = byte_tok.encode("".join(_random_text(rng, "<|endoftext|>") for _ in range(60)))
    assert len(out) > 1000
    det = IncrementalDetokenizer(recording, byte_tok.encode("a prompt of some length " * 20))  # type: ignore[arg-type]
    for t in out:
        det.update([t])
        det.take_delta()
    # One window: a character split over byte tokens plus the token(s) before it as context.
    assert max(lengths) <= 16
    assert det.take_delta(finished=True) == "" and det.output_text == _decode(byte_tok, out)


def test_without_stop_strings_text_is_decoded_when_read(byte_tok: PreTrainedTokenizerBase) -> None:
    """No stop string needs the text: tokens wait until it is read, then one window decodes them all."""
    recording = RecordingTokenizer(byte_tok)
    calls = recording.lengths
    rng = random.Random(5)
    out = byte_tok.encode("".join(_random_text(rng, "<|endoftext|>") for _ in range(5)))
    det = IncrementalDetokenizer(recording, byte_tok.encode("a prompt"))  # type: ignore[arg-type]
    before = len(calls)
    half = len(out) // 2
    for t in out[:half]:
        assert det.update([t]) is None
    assert len(calls) == before
    first = det.take_delta()
    assert len(calls) == before + 2
    for t in out[half:]:
        det.update([t])
    assert first + det.take_delta(finished=True) == det.output_text == _decode(byte_tok, out)


def test_update_after_finish_raises(byte_tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(byte_tok, [])
    det.update(byte_tok.encode("hi"))
    assert det.take_delta(finished=True) == "hi"
    with pytest.raises(RuntimeError):
        det.update([1])


@pytest.mark.slow
def test_embedded_model_tokenizer() -> None:
    try:
        from transformers import AutoTokenizer

        from kiln.models.loader.gguf_import import embedded_model_dir

        tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    except Exception as e:  # optional: the embedded model may be absent or not yet wired up
        pytest.skip(f"embedded model tokenizer unavailable: {e}")
    rng = random.Random(5)
    for _ in range(100):
        ids = tok.encode(_random_text(rng, tok.eos_token or ""), add_special_tokens=False)
        cut = rng.randint(0, len(ids))
        prompt, out = ids[:cut], ids[cut:]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=("xyzzy",))
            assert "".join(_stream(det, _chunks(rng, out))) == _expected_output(tok, prompt, out, skip)
