"""Serve first, tune in the background (kiln/compiler/background.py): an exact size compiled after start-up
and swapped in between two engine steps, mid-generation, gives the same greedy tokens as no swap."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kiln import Runtime, SamplingParams
from kiln.compiler import CompileKey
from kiln.compiler.cuda_graphs import install_cuda_graphs
from kiln.config import CUDAGraphMode, GraphSupport
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


def _tokens(runtime: Runtime, swap_after_steps: int | None = None, pending: int = 3) -> list[list[int]]:
    """Greedy generation driven step by step; with `swap_after_steps`, block there until the background
    compiles are done, so the next step swaps them in (mid-generation, at a step boundary)."""
    engine = runtime.engine
    ids = [engine.add_request(p, PARAMS) for p in random_prompts([5, 9, 3, 12], 200, seed=7)]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == swap_after_steps:
            background = engine.worker.compiled.background
            assert runtime.compile_stats.background_pending == pending  # e.g. 3 distinct pieces x size 4
            assert background.wait(timeout=1800)
            assert runtime.compile_stats.background_pending == pending  # done, but only a step boundary swaps
            assert _pending_gauge(runtime) == pending  # /metrics reads it live
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return [tokens[i] for i in ids]


def _fake_graphs(runtime: Runtime, monkeypatch: pytest.MonkeyPatch):
    """CUDA graphs on CPU through the fake graph of test_cuda_graphs (FULL decode and PIECEWISE at 1-8)."""
    from tests.compiler.test_cuda_graphs import FakeGraph

    worker = runtime.engine.worker
    monkeypatch.setattr(type(worker.backend), "graph_support", GraphSupport.ALWAYS)
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=(1, 2, 4, 8))
    worker.graph_pool = install_cuda_graphs(worker.runner, config, worker.compiled, progress=False, factory=FakeGraph)
    return worker.graph_pool


def test_background_swap_is_token_identical(tiny_checkpoint, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))  # a fresh compile cache, for the warm start
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    reference = Runtime(path, **OPTIONS)
    caplog.set_level(logging.INFO, logger="kiln")
    tuned = Runtime(path, background_compile_sizes=(BATCH,), **OPTIONS)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kiln ready in")]
    assert ready == [f"{tuned.startup_times.summary()}, 3 background compile(s) pending"]  # the start-up log
    assert reference.engine.worker.compiled.background is None
    # the size swapped in is also a CUDA-graph size (as -O2's exact sizes are on a GPU): its graphs, captured
    # with the range artifact, must be captured again at the swap
    pool = _fake_graphs(tuned, monkeypatch)
    graphs_at_batch = {id(c): c.entries[key][0] for c in pool.callables for key in c.entries
                       if getattr(key, "num_tokens", key) == BATCH}
    captured = dict(pool.stats.captures)
    expected = _tokens(reference)
    got = _tokens(tuned, swap_after_steps=3)  # prefill done, a few decode steps from the range artifact
    assert got == expected
    recaptured = {id(c): c.entries[key][0] for c in pool.callables for key in c.entries
                  if getattr(key, "num_tokens", key) == BATCH}
    assert recaptured.keys() == graphs_at_batch.keys() and len(recaptured) > 1  # FULL + each piece's PIECEWISE
    assert all(recaptured[k] is not graphs_at_batch[k] for k in recaptured)  # every graph at BATCH is new
    assert sum(pool.stats.captures.values()) == sum(captured.values()) + len(recaptured)  # and only those
    assert pool.stats.after_warmup_captures == 0 and tuned.engine.graph_replays["FULL"] > 0
    stats = tuned.compile_stats
    assert (stats.background_pending, stats.background_swapped, stats.background_failed) == (0, 3, 0)
    assert _pending_gauge(tuned) == 0  # dropped at the swap
    assert stats.inductor_compiles == 3  # the background compiles ran in a worker, not in the start-up count
    # the swap really happened: 4-token steps now run the exact-size artifact in every compiled piece
    runners = tuned.engine.worker.compiled.capture.runners.values()
    assert all(r.last_key == CompileKey.size(BATCH) for r in runners)
    assert all(r.compiled[CompileKey.size(BATCH)] is not r.compiled[CompileKey.range(1, 32)] for r in runners)
    # a warm start finds the swapped artifacts in the compile cache: they are in before ready (no graph to
    # capture again), nothing is pending, and no worker compiles
    warm = Runtime(path, background_compile_sizes=(BATCH,), **OPTIONS)
    stats = warm.compile_stats
    assert (stats.background_pending, stats.background_swapped, stats.inductor_compiles) == (0, 3, 0)
    assert stats.cache_hits == 6  # 3 pieces x (the range + the background size)
    assert BATCH in warm.engine.worker.compiled.backend.dispatcher.sizes
    assert _tokens(warm) == expected


def test_a_script_without_the_main_guard_compiles_in_its_workers(tmp_path) -> None:
    """kiln's compile workers start from kiln's own entry point, so a plain script that builds a runtime at top
    level (no `if __name__ == "__main__":`) runs once, its compiles run in the two worker processes (the pool
    that background compiles use too) and no worker prints a traceback.

    The script also plants a torch_key: artifacts carry the key of the process that compiled them and a load
    checks it against its own, so the workers' artifacts load in the parent only if the workers were handed the
    parent's key (a worker that computed its own would fail the check, and the parent would compile instead)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from kiln.cache.torch_key import set_torch_key\n"
        "assert set_torch_key(b'p' * 32)\n"
        "from kiln import Runtime, SamplingParams\n"
        "print('script body', flush=True)\n"
        "rt = Runtime('tiny-llama', device='cpu', dtype='fp32', level=2, compile_sizes=(), compile_workers=2, "
        "max_num_batched_tokens=32, max_num_seqs=4)\n"
        "s = rt.compile_stats\n"
        "print('compiles', s.inductor_compiles, 'in workers', s.worker_compiles, flush=True)\n"
        "print(len(rt.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids))\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "KILN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)  # artifacts travel as they do when cached
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the three distinct pieces' range compiles, all in the workers
    assert proc.stdout.splitlines() == ["script body", "compiles 3 in workers 3", "3"], proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _no_partial_cache_entries(cache_dir) -> None:
    """Every artifact in the compile cache unpacks (size and checksum match) and no temporary file is left."""
    from pathlib import Path

    from kiln.cache.store import ARTIFACT_SUFFIX, unpack

    files = [p for p in Path(cache_dir).rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.endswith(".tmp")], files
    artifacts = [p for p in files if p.name.endswith(ARTIFACT_SUFFIX)]
    assert artifacts  # the ranges, saved at start-up
    for artifact in artifacts:
        unpack(artifact.read_bytes())  # raises CorruptArtifact on a half-written one


def test_cancel_stops_running_compiles_and_the_ranges_serve(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path) -> None:
    """`cancel()` while the worker compiles: the worker process is gone, nothing is swapped in (not then, not at
    a later step boundary), and the engine goes on serving the same tokens from its range artifacts; the next
    (warm) start compiles that size in the background and serves the same tokens from it."""
    import time

    path = str(tiny_checkpoint("tiny-llama")[0])
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    runtime = Runtime(path, background_compile_sizes=(BATCH,), **OPTIONS)
    background = runtime.engine.worker.compiled.background
    expected = _tokens(runtime)  # from the range: the worker takes far longer to start than this
    deadline = time.monotonic() + 600  # a bound on the wait for the worker to exist, not on any speed
    while not (background._pool and background._pool.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = background._pool.processes
    assert workers and all(w.is_alive() for w in workers), "the background compile worker never started"
    assert not background.done and runtime.compile_stats.background_pending == 3  # compiles in flight
    background.cancel()
    assert [w.is_alive() for w in workers] == [False] * len(workers)  # terminated and joined
    assert background.done and background.cancelled and not background._thread.is_alive()
    stats = runtime.compile_stats
    assert (stats.background_pending, stats.background_swapped, stats.background_cancelled) == (0, 0, 3)
    assert "3 background compile(s) cancelled" in stats.summary()
    background.cancel()  # idempotent
    assert stats.background_cancelled == 3
    assert not background.swap_if_done() and not runtime.finish_background_compiles(timeout=1)
    assert _tokens(runtime) == expected
    runners = runtime.engine.worker.compiled.capture.runners.values()
    assert all(r.last_key == CompileKey.range(1, 32) for r in runners)  # 4-token steps: still the range
    assert BATCH not in runtime.engine.worker.compiled.backend.dispatcher.sizes
    runtime.shutdown()  # cancels again (a no-op) and returns
    _no_partial_cache_entries(tmp_path / "cache")
    # a warm start loads the captured graph and the ranges from the cache, and compiles the background size that
    # the cancelled start never saved (the saved capture keeps the symbol and input layouts its workers need)
    warm = Runtime(path, background_compile_sizes=(BATCH,), **OPTIONS)
    stats = warm.compile_stats
    assert stats.capture_loaded and (stats.cache_hits, stats.background_pending) == (3, 3)
    assert warm.finish_background_compiles()
    assert (stats.background_swapped, stats.background_failed) == (3, 0)
    assert _tokens(warm) == expected
    assert all(r.last_key == CompileKey.size(BATCH) for r in warm.engine.worker.compiled.capture.runners.values())
    warm.shutdown()


# The script sends its compile workers a compile function that never ends (from a module of its own directory,
# which the workers can import: they get the parent's import path), so the background compiles provably outlast
# the script.
_NEVER_DONE = """
import time


def never_done(*args):
    time.sleep(3600)
"""
_NEVER_ENDING_COMPILES = """
import time

import kiln.compiler.parallel
import never_done

kiln.compiler.parallel._compile_in_worker = never_done.never_done


def main():
    from kiln import Runtime, SamplingParams

    rt = Runtime("tiny-llama", device="cpu", dtype="fp32", level=2, compile_sizes=(), background_compile_sizes=(4,),
                 max_num_batched_tokens=32, max_num_seqs=4)
    out = rt.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0))
    background = rt.engine.worker.compiled.background
    deadline = time.monotonic() + 600
    while not (background._pool and background._pool.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    print("tokens", len(out[0].outputs[0].token_ids), "pending", rt.compile_stats.background_pending, flush=True)
    print("workers", *[p.pid for p in background._pool.processes], flush=True)
    # returns without rt.shutdown(): the interpreter's exit must not wait for the compiles


if __name__ == "__main__":
    main()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_a_script_exits_without_waiting_for_background_compiles(tmp_path) -> None:
    """A script that generates and returns, never shutting its runtime down, exits although its background
    compiles would never end: they are cancelled at exit, their worker terminated (not left orphaned, compiling
    for no one). The bound is the subprocess timeout (the compiles sleep an hour); the worker is gone afterwards
    and the compile cache holds no partial entry."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "one_prompt.py"
    script.write_text(_NEVER_ENDING_COMPILES)
    (tmp_path / "never_done.py").write_text(_NEVER_DONE)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "KILN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    workers = [int(pid) for line in stdout.splitlines() if line.startswith("workers") for pid in line.split()[1:]]
    for pid in workers:  # a hung run leaves its sleeping worker behind: never leave it running
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, (proc.returncode, stdout, stderr[-3000:])
    assert stdout.splitlines()[0] == "tokens 1 pending 3", stdout
    assert workers, stdout
    assert all(_gone(pid) for pid in workers)  # terminated by the cancel, not orphaned
    assert "Traceback" not in stderr, stderr[-3000:]
    _no_partial_cache_entries(tmp_path / "cache")
