"""Serve first, tune in the background (kiln/compiler/background.py): an exact size compiled after start-up
and swapped in between two engine steps, mid-generation, gives the same greedy tokens as no swap."""

from __future__ import annotations

import logging

import pytest

from kiln import Runtime, SamplingParams
from kiln.compiler import CompileKey
from tests.conftest import random_prompts

pytestmark = pytest.mark.slow

BATCH = 4  # four requests decoding: 4-token steps, the background size
OPTIONS = dict(level=2, compile_sizes=(), device="cpu", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=BATCH)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _pending_gauge(runtime: Runtime) -> float:
    """kiln:background_compiles_pending as /metrics renders it for this engine."""
    from prometheus_client.parser import text_string_to_metric_families

    from kiln.entrypoints.server.metrics import ServerMetrics

    text = ServerMetrics(runtime.engine, "m").render()[0].decode()
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "kiln:background_compiles_pending")


def _tokens(runtime: Runtime, swap_after_steps: int | None = None) -> dict[str, list[int]]:
    """Greedy generation driven step by step; with `swap_after_steps`, block there until the background
    compiles are done, so the next step swaps them in (mid-generation, at a step boundary)."""
    engine = runtime.engine
    ids = [engine.add_request(p, PARAMS) for p in random_prompts([5, 9, 3, 12], 200, seed=7)]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == swap_after_steps:
            background = engine.worker.compiled.background
            assert runtime.compile_stats.background_pending == 3  # 3 distinct pieces x size 4, not swapped yet
            assert background.wait(timeout=1800)
            assert runtime.compile_stats.background_pending == 3  # done, but only a step boundary swaps
            assert _pending_gauge(runtime) == 3  # /metrics reads it live
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return [tokens[i] for i in ids]


def test_background_swap_is_token_identical(tiny_checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    reference = Runtime(path, **OPTIONS)
    caplog.set_level(logging.INFO, logger="kiln")
    tuned = Runtime(path, background_compile_sizes=(BATCH,), **OPTIONS)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kiln ready in")]
    assert ready == [f"{tuned.startup_times.summary()}, 3 background compile(s) pending"]  # the start-up log
    assert reference.engine.worker.compiled.background is None
    expected = _tokens(reference)
    got = _tokens(tuned, swap_after_steps=3)  # prefill done, a few decode steps from the range artifact
    assert got == expected
    stats = tuned.compile_stats
    assert (stats.background_pending, stats.background_swapped, stats.background_failed) == (0, 3, 0)
    assert _pending_gauge(tuned) == 0  # dropped at the swap
    assert stats.inductor_compiles == 3  # the background compiles ran in a worker, not in the start-up count
    # the swap really happened: 4-token steps now run the exact-size artifact in every compiled piece
    runners = tuned.engine.worker.compiled.capture.runners.values()
    assert all(r.last_key == CompileKey.size(BATCH) for r in runners)
    assert all(r.compiled[CompileKey.size(BATCH)] is not r.compiled[CompileKey.range(1, 32)] for r in runners)
