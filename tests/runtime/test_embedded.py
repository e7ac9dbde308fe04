"""The embedded SmolLM2-135M-Instruct through kiln (eager, fp32) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def runtime(embedded_dir) -> Runtime:
    return Runtime(str(embedded_dir), level=0, device="cpu", dtype="fp32", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def hf_model(embedded_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()


def test_default_model_is_the_embedded_one(runtime, embedded_dir) -> None:
    from kiln.models.loader.load import resolve_model_source

    assert resolve_model_source(None)[0] == embedded_dir


def test_answers_paris(runtime) -> None:
    out = runtime.chat(FRANCE, SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.outputs[0].text


def test_chat_takes_vllms_batch_of_conversations_and_keyword(runtime) -> None:
    """vLLM's forms: a list of conversations gives their answers in order, each as the conversation alone gets
    it; the params may be passed as sampling_params= (to generate and stream too)."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    other = [{"role": "user", "content": "Name a colour."}]
    batch = runtime.chat([FRANCE, other], sampling_params=params)
    alone = [runtime.chat(FRANCE, params), runtime.chat(other, params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    prompt = runtime.apply_chat_template(FRANCE)
    assert runtime.generate(prompt, sampling_params=params)[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    streamed = [t for out in runtime.stream(prompt, sampling_params=params) for t in out.outputs[0].delta_token_ids]
    assert streamed == alone[0].outputs[0].token_ids


def test_greedy_tokens_match_transformers(runtime, hf_model) -> None:
    tok = runtime.tokenizer
    chats = [FRANCE, [{"role": "user", "content": "Write a haiku about the sea."}],
             [{"role": "user", "content": "List three colours."}]]
    prompts = [runtime.apply_chat_template(c) for c in chats] + [tok("The quick brown fox")["input_ids"]]
    outs = runtime.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 20)


def test_stop_string_across_token_boundary(runtime) -> None:
    prompt = runtime.apply_chat_template(FRANCE)
    full = runtime.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    tok = runtime.tokenizer
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string made of the end of one token and the start of the next
    i = next(i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 2 and len(pieces[i].strip()) >= 2)
    stop = pieces[i - 1][-2:] + pieces[i][:2]
    before = "".join(pieces[: i - 1]) + pieces[i - 1][:-2]
    assert stop in full.text
    out = runtime.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)] and out.text.startswith(before[:5])
    inc = runtime.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop],
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == out.text + stop


def test_the_text_of_the_token_that_stopped_is_left_out(runtime) -> None:
    """vLLM: a stop token id's (or EOS's) text is not in the output unless include_stop_str_in_output; its id is."""
    greedy = runtime.chat(FRANCE, SamplingParams(max_tokens=8, temperature=0.0)).outputs[0].token_ids
    stop = greedy[3]
    for include in (False, True):
        out = runtime.chat(FRANCE, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                                                  include_stop_str_in_output=include)).outputs[0]
        assert out.token_ids == greedy[:4] and out.stop_reason == stop
        assert out.text == runtime.tokenizer.decode(greedy[:4] if include else greedy[:3])
    eos = runtime.chat(FRANCE, SamplingParams(max_tokens=200, temperature=0.0, skip_special_tokens=False)).outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in runtime.engine.eos_token_ids
    assert eos.text == runtime.tokenizer.decode(eos.token_ids[:-1], skip_special_tokens=False)


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ("hello", "^messages must be a non-empty list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([], "^messages must be a non-empty list"),
])
def test_chat_messages_of_the_wrong_shape_name_the_field(runtime, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        runtime.chat(messages, SamplingParams(max_tokens=2))


def test_text_the_tokenizer_cannot_encode_names_the_prompt(runtime) -> None:
    with pytest.raises(ValueError, match="^prompt holds text the tokenizer cannot encode"):
        runtime.generate(["abc \udc80 def"], SamplingParams(max_tokens=2))
    assert not runtime.engine.has_unfinished()


def test_stream_deltas_concatenate_to_text(runtime) -> None:
    prompt = runtime.apply_chat_template(FRANCE)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=["France"])
    deltas, last = [], None
    for last in runtime.stream(prompt, params):
        deltas.append(last.outputs[0].delta_text)
    final = runtime.generate([prompt], params)[0].outputs[0]
    assert last is not None and last.finished
    assert "".join(deltas) == final.text == last.outputs[0].text


def test_bad_words_match_transformers_bad_words_ids(runtime, hf_model) -> None:
    """bad_words=["Paris"] on the capital question: the word never comes, and the greedy tokens are transformers'
    with the same sequences as bad_words_ids (one-token words: banned at every step by both)."""
    from kiln.runtime.sampler import bad_word_sequences

    tok = runtime.tokenizer
    prompt = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt)["input_ids"]
    plain = runtime.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
    assert "Paris" in plain.text
    sequences = bad_word_sequences(tok, ("Paris",))
    assert all(len(s) == 1 for s in sequences)  # a word of one token either way in this vocabulary
    out = runtime.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, bad_words=["Paris"]))[0].outputs[0]
    hf = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=16, do_sample=False, bad_words_ids=[list(s) for s in sequences],
                           pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    assert "Paris" not in out.text and out.token_ids == hf[: len(out.token_ids)]


def test_stop_strings_wait_for_min_tokens(runtime) -> None:
    """As vLLM: a stop string, like a stop token, cannot end the output before min_tokens tokens; it does after."""
    prompt = runtime.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    stopped = runtime.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=["."]))[0].outputs[0]
    k = len(stopped.token_ids)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "." and k < 20
    held = runtime.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=["."],
                                                     min_tokens=k + 3))[0].outputs[0]
    assert len(held.token_ids) >= k + 3 and held.text.startswith(stopped.text + ".")
    assert held.finish_reason == "length" or held.stop_reason == "."
