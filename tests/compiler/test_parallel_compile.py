"""Parallel compilation (kiln/compiler/parallel.py) against serial: the same artifacts in the compile
cache, the same greedy tokens, and a cache that a warm start loads completely (tiny Llama, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln import Runtime, SamplingParams
from kiln.cache.store import ARTIFACT_SUFFIX, READY, compile_root, verify_file
from kiln.compiler.parallel import default_workers
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# -O2 with passes, no exact size: three distinct pieces x one range = three independent compiles
OPTIONS = dict(level=2, compile_sizes=(), device="cpu", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=4)


def test_default_worker_count_follows_the_cores() -> None:
    assert default_workers(100, cores=2) == 1  # the CPU CI host: the serial path
    assert default_workers(100, cores=16) == 8  # half for compile workers, half for their kernel builds
    assert default_workers(100, cores=64) == 16  # each worker holds a CUDA context on a GPU host
    assert default_workers(3, cores=32) == 3 and default_workers(0, cores=32) == 1


def _runtime(checkpoint: Path, cache_dir: Path, workers: int) -> Runtime:
    saved = {k: os.environ.get(k) for k in ("KILN_CACHE_DIR", "KILN_DISABLE_COMPILE_CACHE")}
    os.environ["KILN_CACHE_DIR"] = str(cache_dir)
    os.environ.pop("KILN_DISABLE_COMPILE_CACHE", None)
    try:
        return Runtime(str(checkpoint), compile_workers=workers, **OPTIONS)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _greedy(runtime: Runtime) -> list[list[int]]:
    prompts = random_prompts([5, 11, 3, 30], 200, seed=5)
    return [list(out.outputs[0].token_ids) for out in runtime.generate(prompts, GREEDY)]


def _artifacts(cache_dir: Path) -> dict[str, Path]:
    root = compile_root(cache_dir)
    return {str(p.relative_to(root)): p for p in root.rglob(f"*{ARTIFACT_SUFFIX}")}


@pytest.mark.slow
def test_parallel_compile_matches_serial(tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("tiny-llama")[0]
    serial = _runtime(checkpoint, tmp_path / "serial", workers=1)
    parallel = _runtime(checkpoint, tmp_path / "parallel", workers=2)
    s, p = serial.compile_stats, parallel.compile_stats
    assert s.worker_compiles == 0 and s.inductor_compiles == 3
    # every compile really ran in a worker process (a fallback would compile here)
    assert (p.compile_workers, p.worker_compiles, p.inductor_compiles, p.cache_saves) == (2, 3, 3, 3)
    assert p.cache_key == s.cache_key  # the worker count is not part of the cache key
    serial_files, parallel_files = _artifacts(tmp_path / "serial"), _artifacts(tmp_path / "parallel")
    assert sorted(parallel_files) == sorted(serial_files) and len(parallel_files) == 3
    assert all(verify_file(path) is None for path in parallel_files.values())
    assert (compile_root(tmp_path / "parallel") / p.cache_key / "rank_0" / READY).is_file()
    expected = _greedy(serial)
    assert _greedy(parallel) == expected
    # the store the workers filled is complete: a warm start loads everything and compiles nothing
    warm = _runtime(checkpoint, tmp_path / "parallel", workers=2)
    assert (warm.compile_stats.inductor_compiles, warm.compile_stats.cache_hits) == (0, 3)
    assert _greedy(warm) == expected
