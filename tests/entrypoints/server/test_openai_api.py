"""The official `openai` client against a kiln server: every response must parse into the client's types."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server.conftest import MODEL, Served

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(served: Served) -> None:
    models = served.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_stream_matches_non_stream_and_reports_usage(served: Served) -> None:
    client = served.openai()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    prompt_len = len(served.engine.tokenizer(PROMPT)["input_ids"])
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_len, 8)
    assert full.usage.total_tokens == prompt_len + 8

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)
    # vLLM's stream_options: include_usage is on once the object is given; continuous_usage_stats puts the usage so
    # far on every chunk
    default = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                             stream_options={}))
    assert default[-1].choices == [] and default[-1].usage.completion_tokens == 4
    running = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running[:-1]]
    assert counts == sorted(counts) and counts[-1] == 8 and all(c.usage.prompt_tokens == prompt_len for c in running)


def test_chat_stream_matches_non_stream_and_reports_usage(served: Served) -> None:
    client = served.openai()
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert full.usage.completion_tokens == 10 or full.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    running = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0,
                                                  stream=True, stream_options={"continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in running if c.choices and c.usage is not None]
    assert counted and counted == sorted(counted) and counted[-1] == full.usage.completion_tokens


def test_chat_uses_the_chat_template(served: Served) -> None:
    """The prompt the model saw is exactly the tokenizer's chat template (as Runtime.chat renders it)."""
    response = httpx.post(f"{served.url}/tokenize", json={"messages": QUESTION}, headers=served.headers()).json()
    expected = served.engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert response["tokens"] == expected
    usage = served.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1).usage
    assert usage.prompt_tokens == len(expected)


def test_n2_non_stream_and_stream(served: Served) -> None:
    client = served.openai()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible

    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=2, stream=True,
                                                temperature=1.0, seed=5):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_stop_strings(served: Served) -> None:
    client = served.openai()
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = base.split()
    stop = words[len(words) // 2]
    cut = base[:base.index(stop)]
    for stops in (stop, [stop, "unlikely-never-generated"]):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stops)
        choice = out.choices[0]
        assert choice.text == cut
        assert choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_completion_logprobs(served: Served) -> None:
    out = served.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))  # greedy

    streamed = served.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                  logprobs=1, stream=True)
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs(served: Served) -> None:
    client = served.openai()
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy picks the most likely

    chunks = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [c.token for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logit_bias_through_the_official_client(served: Served) -> None:
    """logit_bias (OpenAI's field, string token ids) bans the greedy first token and forces another; a bias past
    100 is clamped as vLLM does; the logprobs stay the model's own."""
    client = served.openai()
    tokenizer = served.engine.tokenizer
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    first = tokenizer(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)["input_ids"][0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})
    assert not banned.choices[0].text.startswith(plain.choices[0].logprobs.tokens[0])
    forced_id = tokenizer(" blue", add_special_tokens=False)["input_ids"][0]
    forced = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0.9, seed=1,
                                            logit_bias={str(forced_id): 250}, logprobs=True)
    content = forced.choices[0].logprobs.content
    assert forced.choices[0].message.content == tokenizer.decode([forced_id] * 3)
    assert all(c.logprob < -1e-3 for c in content)  # the model's own log-probabilities, not the forced ones


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(served: Served, embedded_dir) -> None:
    """The log-likelihood request of lm-eval's local-completions (echo, logprobs=1, max_tokens=1, token-id prompt):
    the text and tokens start with the prompt's, the first without a logprob; every other prompt token's logprob
    is transformers' teacher-forced one, its top entry the argmax's; the streamed form says the same; vLLM's
    prompt_logprobs field carries the same numbers by token id."""
    import torch
    from transformers import AutoModelForCausalLM

    client = served.openai()
    ids = served.engine.tokenizer(PROMPT)["input_ids"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens) == choice.text
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=2e-3)
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max().item(), abs=2e-3)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1)
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    body = httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                             "prompt_logprobs": 0}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["text"] and not body["choices"][0]["text"].startswith(PROMPT)  # no echo asked
    assert scored[0] is None and len(scored) == len(ids)
    for pos in range(1, len(ids)):
        assert list(scored[pos]) == [str(ids[pos])]
        assert scored[pos][str(ids[pos])]["logprob"] == pytest.approx(lp.token_logprobs[pos], abs=1e-4)
    chat = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1,
                                                                  "prompt_logprobs": 2}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(p) in (2, 3) for p in chat["prompt_logprobs"][1:])


def test_echo_without_generation_scores_the_prompt_alone(served: Served) -> None:
    """echo with max_tokens 0 (OpenAI's and vLLM's prompt scoring): the prompt's text and logprobs, the same as
    the prompt's part of a max_tokens 1 echo, no token generated or counted, finish_reason length; streamed too."""
    client = served.openai()
    prompt_len = len(served.engine.tokenizer(PROMPT)["input_ids"])
    asked = dict(model=MODEL, prompt=PROMPT, temperature=0, logprobs=1, echo=True)
    scored = client.completions.create(max_tokens=0, **asked)
    one = client.completions.create(max_tokens=1, **asked).choices[0].logprobs
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == one.tokens[:-1] and len(one.tokens) == prompt_len + 1
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.token_logprobs[1:-1], abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (prompt_len, 0)
    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True},
                                            **asked))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0


def test_continue_final_message_and_echo_in_chat(served: Served) -> None:
    """continue_final_message renders the last (assistant) message open, as transformers' template does: the same
    text as /v1/completions on that rendering; echo puts the continued message before the reply (streamed too)."""
    client = served.openai()
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    rendered = served.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                           continue_final_message=True, tokenize=False)
    want = client.completions.create(model=MODEL, prompt=rendered, max_tokens=5, temperature=0).choices[0].text
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                         extra_body=extra)
    assert out.choices[0].message.content == want
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + want
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, extra_body={**extra, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content


def test_allowed_token_ids_bad_words_special_tokens_and_truncation(served: Served) -> None:
    client = served.openai()
    tokenizer = served.engine.tokenizer
    allowed = [tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" yes", " no")]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=2,
                                    extra_body={"allowed_token_ids": allowed})
    assert out.choices[0].text and set(out.choices[0].text.split()) <= {"yes", "no"}
    unmarked = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                         extra_body={"add_special_tokens": False, "bad_words": ["blue"]})
    plain_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert unmarked.usage.prompt_tokens == len(plain_ids) and "blue" not in unmarked.choices[0].text
    assert unmarked.choices[0].text == client.completions.create(
        model=MODEL, prompt=plain_ids, max_tokens=3, temperature=0, extra_body={"bad_words": ["blue"]}).choices[0].text
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    ids = tokenizer(PROMPT)["input_ids"]
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=2,
                                                            temperature=0).choices[0].text


def test_multiple_and_token_id_prompts(served: Served) -> None:
    client = served.openai()
    ids = served.engine.tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in sorted(both.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert sorted(both.choices, key=lambda c: c.index)[0].text == by_text.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    usage = None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts[0] == by_text.choices[0].text and set(texts) == {0, 1}
    assert usage.completion_tokens == 8


def test_tokenize_detokenize_health_version(served: Served) -> None:
    tokens = httpx.post(f"{served.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == served.engine.max_model_len
    text = httpx.post(f"{served.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == PROMPT
    assert served.health()["status"] == "ok"
    assert httpx.get(f"{served.url}/version").json()["version"]


def test_cache_salt_on_both_endpoints(served: Served) -> None:
    """A salted request only reuses blocks cached under the same salt (prefix caching, issue 8)."""
    client = served.openai()
    kv = served.engine.kv
    long_text = "The history of bread begins in the Neolithic era. " * 8  # > 3 full blocks

    def hits_after(call) -> int:
        before = kv.hits
        call()
        served.wait_idle()
        return kv.hits - before

    def completion(salt: str) -> None:
        client.completions.create(model=MODEL, prompt=long_text, max_tokens=2, temperature=0.0,
                                  extra_body={"cache_salt": salt})

    def chat(salt: str) -> None:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}],
                                       max_tokens=2, temperature=0.0, extra_body={"cache_salt": salt})

    for call in (completion, chat):
        assert hits_after(lambda call=call: call("salt-one")) == 0
        assert hits_after(lambda call=call: call("salt-two")) == 0
        assert hits_after(lambda call=call: call("salt-one")) >= 48


def test_cors_preflight_and_headers(served: Served) -> None:
    """vLLM's defaults: any origin, method and header, so a browser UI on another origin can call the API."""
    preflight = httpx.options(f"{served.url}/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    listing = httpx.get(f"{served.url}/v1/models", headers={"Origin": "http://example.com", **served.headers()})
    assert listing.status_code == 200 and listing.headers["access-control-allow-origin"] == "*"
