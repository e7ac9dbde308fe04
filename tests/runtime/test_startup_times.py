"""The start-up record: every phase timed, logged as one summary line, and consistent with the totals it
is made of (the compiler's own trace time, the loader's own load time, the engine's wall time)."""

from __future__ import annotations

import logging
import time

import pytest

from kiln import Runtime
from kiln.runtime.startup import PHASES, StartupTimes


def test_startup_times_cover_each_phase_and_are_logged(tiny_checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    caplog.set_level(logging.INFO, logger="kiln")
    before = time.perf_counter()
    rt = Runtime(path, device="cpu", level=1, compile_sizes=(), max_num_batched_tokens=64, max_num_seqs=4,
                 num_blocks=64)
    outside = time.perf_counter() - before
    times = rt.startup_times
    assert isinstance(times, StartupTimes) and times is rt.engine.startup_times
    # the phases never add up to more than the total, which is within the constructor's wall time
    assert all(getattr(times, p) >= 0 for p in PHASES)
    assert sum(getattr(times, p) for p in PHASES) <= times.total <= outside
    assert times.other == pytest.approx(times.total - sum(getattr(times, p) for p in PHASES))
    # each phase is what the part that ran it measured: the loader, Dynamo's trace, the compile phase
    assert times.load >= rt.engine.loaded.load_seconds > 0
    stats = rt.compile_stats
    assert stats.dynamo_traces == 1 and times.trace == pytest.approx(stats.trace_seconds) and times.trace > 0
    assert times.compile > 0 and times.kv > 0 and times.tokenizer > 0
    assert stats.startup == pytest.approx(times.as_dict())  # Runtime.compile_stats carries the record too
    assert stats.as_dict()["startup"]["load"] == times.load
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kiln ready in")]
    assert lines == [times.summary()]
    for phase in PHASES:
        assert f" {phase} {getattr(times, phase):.1f}" in lines[0]


def test_startup_summary_format() -> None:
    times = StartupTimes(total=12.34, load=4.1, tokenizer=0.2, trace=1.0, compile=3.2, kv=0.4, capture=2.9)
    assert times.summary() == ("kiln ready in 12.3 s: load 4.1, tokenizer 0.2, trace 1.0, compile 3.2, kv 0.4, "
                               "capture 2.9, other 0.5")
    assert times.as_dict()["other"] == pytest.approx(0.54)
