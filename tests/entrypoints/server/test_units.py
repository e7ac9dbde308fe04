"""Pieces of the server that need no model: request mapping, logprob shapes, auth, benchmark statistics."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from kiln.entrypoints.bench.datasets import random_requests, sharegpt_requests
from kiln.entrypoints.bench.serve import RequestResult, format_table, summarize
from kiln.entrypoints.server.auth import ApiKeyMiddleware
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.logprobs import chat_logprobs, completion_logprobs, next_offset
from kiln.entrypoints.server.protocol import CompletionRequest
from kiln.entrypoints.server.serving_common import make_params, sampling_fields
from kiln.runtime.outputs import Logprob, TokenLogprobs


def test_request_fields_map_onto_sampling_params() -> None:
    req = CompletionRequest(prompt="x", temperature=0.5, top_k=-1, stop="END", stop_token_ids=[2], seed=3, n=2,
                            ignore_eos=True, user="someone", parallel_tool_calls=False)
    params = make_params({**sampling_fields(req), "max_tokens": 7})
    assert (params.temperature, params.top_k, params.stop, params.stop_token_ids) == (0.5, 0, ("END",), (2,))
    assert (params.seed, params.n, params.ignore_eos, params.max_tokens) == (3, 2, True, 7)
    assert params.top_p == 1.0  # unset stays at the default
    with pytest.raises(APIError) as info:
        make_params({"max_tokens": 1, "top_p": 2.0})
    assert (info.value.status, info.value.param) == (400, "top_p")


def test_token_id_prompts_stay_one_prompt() -> None:
    assert CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]
    assert CompletionRequest(prompt=["a", "b"]).prompt == ["a", "b"]


def _positions() -> list[TokenLogprobs]:
    a, b = Logprob(1, -0.5, 1, "Hel"), Logprob(2, -1.5, 2, "lo")
    return [TokenLogprobs(a, [a, Logprob(9, -2.0, 2, "X")]), TokenLogprobs(b, [Logprob(3, -1.0, 1, "p"), b]),
            TokenLogprobs(Logprob(4, -math.inf, 5, None), [])]


def test_completion_logprobs_shape() -> None:
    lp = completion_logprobs(_positions(), text_offset=10)
    assert lp.tokens == ["Hel", "lo", "token_id:4"]
    assert lp.text_offset == [10, 13, 15]
    assert lp.token_logprobs == [-0.5, -1.5, -9999.0]  # -inf is not JSON
    assert lp.top_logprobs == [{"Hel": -0.5, "X": -2.0}, {"p": -1.0, "lo": -1.5}, {"token_id:4": -9999.0}]
    assert next_offset(lp) == 15 + len("token_id:4")
    json.loads(lp.model_dump_json())


def test_chat_logprobs_shape() -> None:
    content = chat_logprobs(_positions()[:2], top_k=1).content
    assert [c.token for c in content] == ["Hel", "lo"]
    assert content[0].bytes == list(b"Hel") and [t.token for t in content[1].top_logprobs] == ["p"]


def test_api_key_middleware() -> None:
    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    errors: list[int] = []
    guarded = ApiKeyMiddleware(app, "secret", on_error=errors.append)

    async def statuses() -> list[int]:
        transport = httpx.ASGITransport(app=guarded)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [(await client.get("/v1/models")).status_code,
                    (await client.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code,
                    (await client.get("/v1/models", headers={"Authorization": "Bearer secret"})).status_code,
                    (await client.get("/health")).status_code, (await client.post("/tokenize")).status_code]

    assert asyncio.run(statuses()) == [401, 401, 200, 200, 401]
    assert errors == [401, 401, 401]


def test_benchmark_summary_and_table() -> None:
    results = [RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
               RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.3, latency=0.5, itl=[0.1, 0.1]),
               RequestResult(ok=False, error="HTTP 503: busy")]
    summary = summarize(results, duration=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert summary["total_output_tokens"] == 8 and summary["output_throughput"] == 4.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["itl_ms"]["median"] == pytest.approx(100)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.5-0.3)/2
    table = format_table(summary)
    assert "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table and "error: HTTP 503: busy" in table


def test_datasets(tmp_path: Path) -> None:
    reqs = random_requests(50, 20, 10, range_ratio=0.5, seed=1)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(str(r.prompt).split()) == r.prompt_len for r in reqs)
    ids = random_requests(3, 8, 4, vocab_size=100)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 8 for r in ids)
    for lengths, name in (((0, 4), "input_len"), ((8, 0), "output_len")):  # not silently drawn as 1
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            random_requests(3, *lengths)
    path = tmp_path / "sg.json"
    long_reply = "word " * 50
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "please say something nice"},
                                                   {"from": "gpt", "value": long_reply}]},
                                {"conversations": [{"from": "human", "value": "hi"}]},
                                {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}]))
    reqs = sharegpt_requests(path, 10)
    assert len(reqs) == 1 and reqs[0].prompt == "please say something nice" and reqs[0].output_len > 50
    assert sharegpt_requests(path, 10, output_len=7)[0].output_len == 7
    path.write_text("[]")
    with pytest.raises(ValueError, match="no usable"):
        sharegpt_requests(path, 1)
