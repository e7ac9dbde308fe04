"""Several callers of one Runtime (kiln/runtime/output_router.py): a stream left open while generate runs, two
streams read in turn, generate from several threads, an interrupted generate. Each caller gets exactly its own
tokens (equal to the request run alone: greedy output is batch-invariant on this fp32 model) and nothing of a
finished or interrupted call stays in the engine."""

from __future__ import annotations

import threading

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import assert_pool_clean
from tests.conftest import cpu_runtime as make

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], [11, 3], [40, 41, 42, 43, 44], [8]]


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint) -> Runtime:
    return make(tiny_checkpoint("tiny-llama"), max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def alone(runtime) -> list[list[int]]:
    return [runtime.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def streamed_tokens(stream) -> list[int]:
    return [t for out in stream for t in out.outputs[0].delta_token_ids]


def test_generate_while_a_stream_is_open(runtime, alone) -> None:
    """generate used to consume the open stream's outputs, its final one too: the stream then waited forever."""
    stream = runtime.stream(PROMPTS[0], GREEDY)
    first = next(stream).outputs[0].delta_token_ids
    outputs = runtime.generate(PROMPTS[1:3], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == alone[1:3]
    assert first + streamed_tokens(stream) == alone[0]
    assert not runtime.engine.has_unfinished()
    assert_pool_clean(runtime)


def test_two_streams_read_in_turn(runtime, alone) -> None:
    a, b = runtime.stream(PROMPTS[0], GREEDY), runtime.stream(PROMPTS[3], GREEDY)
    head_a, head_b = next(a).outputs[0].delta_token_ids, next(b).outputs[0].delta_token_ids
    assert head_a + streamed_tokens(a) == alone[0]
    assert head_b + streamed_tokens(b) == alone[3]
    assert_pool_clean(runtime)


def test_generate_from_several_threads(runtime, alone) -> None:
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            prompts = [PROMPTS[i], PROMPTS[(i + 1) % len(PROMPTS)]]
            results[i] = [o.outputs[0].token_ids for o in runtime.generate(prompts, GREEDY)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == {i: [alone[i], alone[(i + 1) % len(PROMPTS)]] for i in range(3)}
    assert not runtime.engine.has_unfinished()
    assert_pool_clean(runtime)


def test_an_interrupted_generate_leaves_nothing_running(runtime, alone, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step, calls = runtime.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(runtime.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        runtime.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    assert not runtime.engine.has_unfinished()
    assert_pool_clean(runtime)
    assert runtime.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == alone[0]
