"""AsyncEngine on a tiny dummy-weight model (no HTTP): the step thread, aborts, step failures, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from kiln.entrypoints.server.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineUnavailableError,
    RequestAborted,
    merge_outputs,
)
from kiln.runtime.engine import Engine
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.runtime import build_config
from kiln.runtime.sampling_params import SamplingParams

T = TypeVar("T")
PROMPT = [5, 6, 7, 8, 9]


def make_engine(**kwargs: Any) -> Engine:
    options = {"level": 0, "device": "cpu", "num_blocks": 64, **kwargs}
    return Engine(build_config("tiny-llama", **options))


def run(engine: Engine, body: Callable[[AsyncEngine], Awaitable[T]], **kwargs: Any) -> T:
    async def main() -> T:
        async_engine = AsyncEngine(engine, **kwargs)
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def greedy(max_tokens: int = 4, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def test_merge_outputs_concatenates_deltas() -> None:
    def out(i: int, text: str, finished: bool) -> RequestOutput:
        comp = CompletionOutput(0, "ab"[: i + 1], [1] * (i + 1), "length" if finished else None,
                                delta_text=text, delta_token_ids=[10 + i])
        return RequestOutput("r", None, [1], [comp], finished)

    merged = merge_outputs([out(0, "a", False), out(1, "b", True)])
    assert merged.finished and merged.outputs[0].delta_text == "ab"
    assert merged.outputs[0].delta_token_ids == [10, 11] and merged.outputs[0].finish_reason == "length"


def test_generates_like_the_engine_itself() -> None:
    engine = make_engine()
    expected = engine.add_request(PROMPT, greedy(6))
    while engine.has_unfinished():
        for o in engine.step():
            final = o
    assert final.request_id == expected

    async def body(ae: AsyncEngine) -> list[int]:
        stream = await ae.add_request("a", PROMPT, greedy(6))
        tokens: list[int] = []
        async for out in stream:
            tokens += out.outputs[0].delta_token_ids
        return tokens

    assert run(engine, body) == final.outputs[0].token_ids


def test_abort_frees_blocks_before_the_next_step() -> None:
    engine = make_engine()

    async def body(ae: AsyncEngine) -> tuple[int, int]:
        stream = await ae.add_request("a", PROMPT, greedy(200))
        await stream.next()
        ae.abort("a")
        # call() queues behind the abort on the engine thread, so it sees the state right after it
        allocated = await ae.call(lambda: engine.kv.num_allocated_requests)
        with pytest.raises(RequestAborted):  # after any outputs still queued from before the abort
            while True:
                await stream.next()
        return allocated, len(engine.scheduler.running)

    assert run(engine, body) == (0, 0)
    assert engine.pool.num_free == engine.pool.num_usable


def test_step_failure_fails_the_batch_only_and_keeps_serving() -> None:
    engine = make_engine(max_num_seqs=2)
    real = engine.runner.execute
    failed = {"done": False}

    def execute(sched: Any, *args: Any, **kwargs: Any) -> Any:
        # the first step that runs a and b together (not "the second step": on a loaded machine the engine thread
        # ran two steps of a alone before b arrived, and b then finished; a's 32 tokens outlast b's arrival)
        if not failed["done"] and {"a", "b"} <= {req.request_id for req in sched.requests}:
            failed["done"] = True
            raise RuntimeError("boom")
        return real(sched, *args, **kwargs)

    engine.runner.execute = execute  # type: ignore[method-assign]

    async def body(ae: AsyncEngine) -> list[str]:
        streams = [await ae.add_request(rid, PROMPT, greedy(32 if rid != "c" else 5)) for rid in ("a", "b", "c")]

        async def drain(stream: Any) -> str:
            try:
                async for out in stream:
                    if out.finished:
                        return out.outputs[0].finish_reason
            except EngineStepError as exc:
                assert "boom" in str(exc)
                return "failed"
            return "?"

        results = list(await asyncio.gather(*(drain(s) for s in streams)))
        results.append(await drain(await ae.add_request("d", PROMPT, greedy(3))))
        return results

    # a and b were in the failing batch; c was waiting (max_num_seqs=2) and d came later: both are fine
    assert run(engine, body) == ["failed", "failed", "length", "length"]
    assert engine.kv.num_allocated_requests == 0 and engine.pool.num_free == engine.pool.num_usable


def test_rejections() -> None:
    engine = make_engine()

    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="token ids"):
            await ae.add_request("bad", [10**6], greedy())
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await ae.add_request("empty", [], greedy())
        ae.max_queue = 0
        with pytest.raises(EngineUnavailableError) as info:
            await ae.add_request("full", PROMPT, greedy())
        assert info.value.code == "queue_full"
        ae.max_queue = None
        ae.stop_accepting()
        with pytest.raises(EngineUnavailableError) as info:
            await ae.add_request("late", PROMPT, greedy())
        assert info.value.code == "shutting_down"

    run(engine, body)
    assert engine.kv.num_allocated_requests == 0


def test_params_built_from_the_prompt_length_on_the_engine_thread() -> None:
    engine = make_engine()

    async def body(ae: AsyncEngine) -> SamplingParams:
        stream = await ae.add_request("a", lambda: list(PROMPT), lambda ids: greedy(len(ids)))
        async for _ in stream:
            pass
        return stream.params

    assert run(engine, body).max_tokens == len(PROMPT)


def test_shutdown_fails_in_flight_requests_and_frees_their_blocks() -> None:
    engine = make_engine()

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("a", PROMPT, greedy(200))
        await stream.next()
        await ae.shutdown()
        with pytest.raises(EngineUnavailableError):
            async for _ in stream:
                pass
        assert not ae.is_healthy

    asyncio.run(main())
    assert engine.kv.num_allocated_requests == 0
