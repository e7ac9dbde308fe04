"""Many clients at once: 64 concurrent streams give Runtime.generate's greedy outputs; 100 clients that hang
up mid-request leave no KV block allocated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kiln import Runtime, SamplingParams
from tests.entrypoints.server.conftest import KV_BYTES, MODEL, Served

pytestmark = pytest.mark.slow

TOPICS = ["rivers", "mountains", "cats", "bread", "music", "winter", "trains", "gardens"]
COMPLETION_PROMPTS = [f"Fact {i} about {TOPICS[i % 8]}:" for i in range(56)]
CHATS = [[{"role": "user", "content": f"Name one thing about {topic}."}] for topic in TOPICS]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(embedded_dir: Path) -> tuple[list[str], list[str]]:
    """Greedy outputs from Runtime.generate on the same model: completions, then chats."""
    runtime = Runtime(str(embedded_dir), level=0, device="cpu", kv_cache_bytes=KV_BYTES)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    chat_ids = [runtime.apply_chat_template(m) for m in CHATS]
    outs = runtime.generate(COMPLETION_PROMPTS + chat_ids, params)
    texts = [o.outputs[0].text for o in outs]
    return texts[:len(COMPLETION_PROMPTS)], texts[len(COMPLETION_PROMPTS):]


def test_64_concurrent_streams_match_runtime_generate(served: Served, reference: tuple[list[str], list[str]]) -> None:
    client = served.async_openai()

    async def completion(prompt: str) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, finish, used = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def chat(messages: list[dict[str, str]]) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                      max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        text, finish, used = "", None, -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def everyone() -> list[tuple[str, str | None, int]]:
        jobs = [completion(p) for p in COMPLETION_PROMPTS] + [chat(m) for m in CHATS]
        return list(await asyncio.gather(*jobs))

    results = asyncio.run(everyone())
    assert len(results) == 64
    expected_completions, expected_chats = reference
    assert [r[0] for r in results] == expected_completions + expected_chats
    assert all(r[1] in ("length", "stop") and 1 <= r[2] <= MAX_TOKENS for r in results)
    health = served.wait_idle()
    assert health["kv_allocated_requests"] == 0


def test_100_disconnecting_clients_free_every_kv_block(served: Served) -> None:
    url = f"{served.url}/v1/completions"
    long_request = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}  # would run ~a minute if not aborted

    async def hang_up_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        body = {**long_request, "prompt": f"Story {i}: once upon a time", "stream": True}
        seen = 0
        async with client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= 2:
                    break
        return seen  # leaving the block closes the connection with the response unread

    async def hang_up_official_client(i: int) -> int:
        client = served.async_openai()
        stream = await client.completions.create(model=MODEL, prompt=f"Poem {i}:", max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        await client.close()
        return 1

    async def give_up_waiting(i: int) -> int:
        async with httpx.AsyncClient(timeout=2.0) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, json={**long_request, "prompt": f"Essay {i}:"})
        return 1

    async def everyone() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            jobs = [hang_up_mid_stream(client, i) for i in range(80)]
            jobs += [hang_up_official_client(i) for i in range(10)]
            jobs += [give_up_waiting(i) for i in range(10)]
            return list(await asyncio.gather(*jobs))

    aborted_before = served.engine.stats.requests_finished.get("abort", 0)
    results = asyncio.run(everyone())
    assert len(results) == 100 and all(results)
    health = served.wait_idle(timeout=60)
    engine = served.engine
    assert engine.kv.num_allocated_requests == 0
    assert engine.pool.num_free == engine.pool.num_usable
    assert health["kv_free_blocks"] == health["kv_usable_blocks"]
    # every one of them was aborted, none ran to its 200 tokens
    assert engine.stats.requests_finished.get("abort", 0) - aborted_before == 100
    # greedy, so the check cannot flake on a sampled end-of-text token
    out = served.openai().completions.create(model=MODEL, prompt="Still there?", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
