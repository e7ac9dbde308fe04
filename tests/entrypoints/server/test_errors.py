"""Every error returns its status and an OpenAI-style body, and the very next normal request succeeds."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server.conftest import MODEL, Served

pytestmark = pytest.mark.slow

KEY = "sk-kiln-test"
SERVER_OPTIONS = {"api_key": KEY, "max_model_len": 128, "max_n": 4}
POISON = "zebra quartz poison pill"  # a prompt the fault injector recognises


def post(served: Served, path: str, body: Any = None, *, content: bytes | None = None,
         key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{served.url}{path}", content=content, headers=headers, timeout=60)
    return httpx.post(f"{served.url}{path}", json=body, headers=headers, timeout=60)


def expect_error(resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None,
                 contains: str = "") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert contains.lower() in error["message"].lower(), error
    return error


def still_serves(served: Served) -> None:
    out = served.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 2


def test_bad_json(served: Served) -> None:
    expect_error(post(served, "/v1/completions", content=b'{"model": "smol", "prompt": '), 400, contains="json")
    expect_error(post(served, "/v1/chat/completions", content=b"[1, 2]"), 400)
    still_serves(served)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 50}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 129}, "truncate_prompt_tokens"),  # > max_model_len
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
])
def test_validation_errors(served: Served, path: str, body: dict[str, Any], param: str) -> None:
    expect_error(post(served, path, body), 400, param=param)
    still_serves(served)


def test_validation_error_through_the_official_client(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.openai().completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    still_serves(served)


def test_prompt_longer_than_max_model_len(served: Served) -> None:
    expect_error(post(served, "/v1/completions", {"prompt": [7] * 200}), 400, param="prompt",
                 contains="max_model_len")
    long_chat = {"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 4}
    expect_error(post(served, "/v1/chat/completions", long_chat), 400, contains="max_model_len")
    with pytest.raises(openai.BadRequestError):
        served.openai().completions.create(model=MODEL, prompt="word " * 300, max_tokens=2)
    still_serves(served)


def test_max_tokens_beyond_the_context_is_a_400_stating_both_numbers(served: Served) -> None:
    """vLLM's rule: prompt + max_tokens > max_model_len is refused (not clamped to hours of generation)."""
    client = served.openai()
    prompt = [7] * 10
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=100000)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "max_tokens"
    assert "100000" in error["message"] and "10 tokens" in error["message"] and "128" in error["message"]
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=100000, stream=True)
    assert info.value.body["param"] == "max_tokens" and "100000" in info.value.body["message"]
    still_serves(served)
    # exactly the rest of the context is fine, and so is leaving max_tokens unset (= the rest of the context)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=118, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 118 and full.choices[0].finish_reason == "length"
    rest = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == 128
    assert served.wait_idle()["kv_allocated_requests"] == 0


def test_n_beyond_max_n_is_a_400(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=5)
    assert info.value.body["param"] == "n" and "max_n" in info.value.body["message"]
    out = served.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=4, temperature=0)
    assert len(out.choices) == 4
    still_serves(served)


def test_unknown_model(served: Served) -> None:
    expect_error(post(served, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, param="model",
                 code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        served.openai().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    still_serves(served)


def test_api_key(served: Served) -> None:
    expect_error(post(served, "/v1/completions", {"prompt": "x"}, key=None), 401, code="invalid_api_key")
    expect_error(post(served, "/v1/completions", {"prompt": "x"}, key="wrong"), 401, code="invalid_api_key")
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        served.openai(api_key="wrong").models.list()
    # probes and scrapers carry no key
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 200
    still_serves(served)


def test_unknown_route(served: Served) -> None:
    expect_error(post(served, "/v1/nothing-here", {}), 404)
    still_serves(served)


def test_queue_full(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    served.ctx.engine.max_queue = 1
    monkeypatch.setattr(type(served.ctx.engine), "num_waiting", property(lambda self: 1))  # one waits already
    try:
        expect_error(post(served, "/v1/completions", {"prompt": "x"}), 503, code="queue_full")
        with pytest.raises(openai.InternalServerError):
            served.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        served.ctx.engine.max_queue = None
    monkeypatch.undo()
    still_serves(served)


def test_a_request_larger_than_the_queue_is_a_400_not_a_retry(served: Served) -> None:
    """More sequences than the queue ever holds: retrying (what a 503 asks for) could never succeed."""
    served.wait_idle()
    served.ctx.engine.max_queue = 2
    try:
        expect_error(post(served, "/v1/completions", {"prompt": "x", "n": 3, "max_tokens": 1}), 400, param="n")
        expect_error(post(served, "/v1/completions", {"prompt": ["x", "y"], "n": 2, "max_tokens": 1}), 400,
                     param="prompt")
        expect_error(post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3,
                                                           "max_tokens": 1}), 400, param="n")
        # at the limit it is queued: each prompt stops counting as pending before the next is added
        for _ in range(5):
            at_the_limit = post(served, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 1})
            assert at_the_limit.status_code == 200, at_the_limit.text
    finally:
        served.ctx.engine.max_queue = None
    still_serves(served)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "abc \udc80 def", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"], "max_tokens": 2, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 2, "bad_words": ["\ud800"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.list[TextContentPart].0.text"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(served: Served, path: str, body: dict, param: str) -> None:
    """JSON can spell a lone UTF-16 surrogate; it is no character, and the tokenizer refuses it (it was a 500)."""
    raw = json.dumps(body).encode()  # ASCII, the surrogate escaped as JSON spells it
    expect_error(post(served, path, content=raw), 400, param=param, contains="surrogate")
    still_serves(served)


def test_null_means_the_default_as_openai_clients_send_it(served: Served) -> None:
    """The official client sends null for an argument left as None: the field's default, not a 400."""
    client = served.openai()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=None, n=None, stream=None, temperature=0)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    body = {"prompt": "hi", "max_tokens": 2, "n": None, "echo": None, "stream": None, "logprobs": None}
    response = post(served, "/v1/completions", body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1, response.text
    required = expect_error(post(served, "/v1/completions", {"prompt": None}), 400)  # a required field stays so
    assert required["param"].startswith("prompt"), required


@pytest.fixture
def faulty_engine(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runner raises whenever the poison prompt is in the batch (like a device error would)."""
    runner = served.engine.runner
    real = runner.execute
    poison = served.engine.tokenizer(POISON)["input_ids"]

    def execute(sched: Any, *args: Any, **kwargs: Any) -> Any:
        if any(req.prompt_token_ids[:len(poison)] == poison for req in sched.requests):
            raise RuntimeError("injected device failure")
        return real(sched, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)


def test_engine_failure_fails_only_that_request(served: Served, faulty_engine: None) -> None:
    failures = served.ctx.engine.num_step_failures
    expect_error(post(served, "/v1/completions", {"prompt": POISON, "max_tokens": 4}), 500, code="engine_error",
                 contains="injected device failure")
    with pytest.raises(openai.APIError, match="injected device failure"):
        for _ in served.openai().completions.create(model=MODEL, prompt=POISON, max_tokens=4, stream=True):
            pass
    assert served.ctx.engine.num_step_failures == failures + 2
    still_serves(served)
    health = served.wait_idle()
    assert health["kv_allocated_requests"] == 0 and health["kv_free_blocks"] == health["kv_usable_blocks"]


def test_draining_refuses_new_requests(served: Served) -> None:
    """Last in this module: once draining starts it does not end."""
    still_serves(served)
    served.ctx.engine.stop_accepting()
    expect_error(post(served, "/v1/completions", {"prompt": "x"}), 503, code="shutting_down")
    assert httpx.get(f"{served.url}/health").status_code == 503
