"""The artifact cache end to end on CPU (tiny Llama, -O1: three Inductor compiles when cold).

A second Runtime on the same model (from another directory) compiles nothing and generates the same
tokens; damaged artifacts are recompiled with a warning; two concurrent warm-ups both succeed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.cache import inductor_writes
from kiln.cache.store import ARTIFACT_SUFFIX, CAPTURE, READY, compile_root, pack, unpack, verify_file
from tests.conftest import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(level=1, device="cpu", dtype="fp32", max_num_batched_tokens=32, max_num_seqs=4)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("kiln_cache")
    saved = {k: os.environ.get(k) for k in ("KILN_CACHE_DIR", "KILN_DISABLE_COMPILE_CACHE")}
    os.environ["KILN_CACHE_DIR"] = str(path)
    os.environ.pop("KILN_DISABLE_COMPILE_CACHE", None)
    yield path
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("tiny-llama")[0]


@pytest.fixture(scope="module")
def kernel_warmups() -> Iterator[list[int]]:
    """Every start's call of the kiln-kernel warm-up (a GPU-only process, recorded here on CPU): a start whose
    compile cache is ready starts none (kiln/runtime/kernel_warmup.py)."""
    from kiln.runtime.worker import Worker

    calls: list[int] = []
    original = Worker._start_kernel_warmup

    def recording(self: Worker):
        calls.append(1)
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Worker, "_start_kernel_warmup", recording)
        yield calls


@pytest.fixture(scope="module")
def cold(cache_dir: Path, checkpoint: Path, kernel_warmups: list[int]) -> Runtime:
    runtime = Runtime(str(checkpoint), **OPTIONS)
    assert kernel_warmups == [1]  # a cold cache: kiln's kernels are warmed up beside the compiles
    return runtime


def greedy(runtime: Runtime) -> list[list[int]]:
    prompts = random_prompts([5, 11, 3], 200, seed=3)
    return [list(out.outputs[0].token_ids) for out in runtime.generate(prompts, GREEDY)]


def artifacts(cache_dir: Path) -> list[Path]:
    return sorted(compile_root(cache_dir).rglob(f"*{ARTIFACT_SUFFIX}"))


def test_cold_start_fills_the_cache(cold: Runtime, cache_dir: Path) -> None:
    stats = cold.compile_stats
    assert stats.cache_key is not None and stats.cache_hits == 0
    assert stats.inductor_compiles == stats.cache_saves == 3
    key_dir = compile_root(cache_dir) / stats.cache_key
    assert (key_dir / "cache_key_factors.json").is_file()
    assert (key_dir / "rank_0" / READY).is_file() and (key_dir / "rank_0" / "split_graph.txt").is_file()
    assert len(artifacts(cache_dir)) == 3 and all(verify_file(p) is None for p in artifacts(cache_dir))
    # Inductor's own cache (its generated code and built libraries) was written under the key, not /tmp
    assert any((key_dir / "inductor").rglob("*.py"))
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR", "") != str(key_dir / "inductor")  # restored afterwards


def inodes(root: Path) -> dict[Path, int]:
    return {path: path.stat().st_ino for path in root.rglob("*") if path.is_file()}


def test_warm_start_compiles_nothing(cold: Runtime, checkpoint: Path, cache_dir: Path, tmp_path: Path,
                                    kernel_warmups: list[int]) -> None:
    moved = tmp_path / "elsewhere"  # the model's location is not part of the key
    shutil.copytree(checkpoint, moved)
    before = len(kernel_warmups)
    inductor_files = inodes(compile_root(cache_dir) / cold.compile_stats.cache_key / "inductor")
    skipped = inductor_writes.skipped
    warm = Runtime(str(moved), **OPTIONS)
    assert len(kernel_warmups) == before  # the cache is ready: no kernel warm-up either
    # loading the artifacts wrote none of Inductor's cache files again (a rewrite renames a new inode over one)
    after = inodes(compile_root(cache_dir) / cold.compile_stats.cache_key / "inductor")
    assert {path: after.get(path) for path in inductor_files} == inductor_files
    assert inductor_writes.skipped > skipped
    stats = warm.compile_stats
    assert stats.inductor_compiles == 0 and stats.cache_hits == 3, stats.summary()
    assert stats.dynamo_traces == 0 and stats.capture_loaded, stats.summary()  # the saved split graph, no trace
    assert warm.compile_stats.num_pieces == cold.compile_stats.num_pieces
    assert stats.cache_key == cold.compile_stats.cache_key
    assert stats.cold_warmup_seconds is not None
    assert greedy(warm) == greedy(cold)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_artifact_is_recompiled(damage: str, cold: Runtime, checkpoint: Path, cache_dir: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    victim = artifacts(cache_dir)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    assert verify_file(victim) is not None
    with caplog.at_level(logging.WARNING, logger="kiln.cache"):
        runtime = Runtime(str(checkpoint), **OPTIONS)
    stats = runtime.compile_stats
    assert stats.inductor_compiles == 1 and stats.cache_hits == 2 and stats.cache_recovered == 1
    assert any("discarding artifact" in r.getMessage() and victim.name in r.getMessage() for r in caplog.records)
    assert verify_file(victim) is None  # rewritten, and the key is ready again
    assert (victim.parent / READY).is_file()
    assert greedy(runtime) == greedy(cold)


def test_damaged_captured_graph_falls_back_to_tracing(cold: Runtime, checkpoint: Path, cache_dir: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    saved = next(compile_root(cache_dir).rglob(CAPTURE))
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="kiln.cache"):
        runtime = Runtime(str(checkpoint), **OPTIONS)
    stats = runtime.compile_stats
    assert stats.dynamo_traces == 1 and not stats.capture_loaded and stats.inductor_compiles == 0
    assert any(CAPTURE in r.getMessage() for r in caplog.records)
    assert greedy(runtime) == greedy(cold)
    assert unpack(saved.read_bytes())  # saved again by the start that traced


def test_captured_graph_that_does_not_fit_the_model_is_not_used(cold: Runtime, checkpoint: Path, cache_dir: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from kiln.compiler import saved_capture

    path = next(compile_root(cache_dir).rglob(CAPTURE))
    original = path.read_bytes()
    saved = saved_capture.load(unpack(original))
    first = next(i for i, info in enumerate(saved.inputs) if info.shape is not None)
    saved.inputs[first] = saved_capture.InputInfo(saved.inputs[first].source, (3, 3), saved.inputs[first].dtype)
    path.write_bytes(pack(saved_capture.dump(saved.split_module, saved.pieces, saved.inputs)))
    try:
        with caplog.at_level(logging.WARNING, logger="kiln.compiler"):
            runtime = Runtime(str(checkpoint), **OPTIONS)
        stats = runtime.compile_stats
        assert stats.dynamo_traces == 1 and stats.inductor_compiles == 0 and stats.cache_hits == 3
        assert any("does not evaluate to the traced input" in r.getMessage() for r in caplog.records)
        assert greedy(runtime) == greedy(cold)
    finally:
        path.write_bytes(original)


def test_a_saved_capture_keeps_the_module_records(cold: Runtime, cache_dir: Path) -> None:
    """The pickled pieces come back with their nodes' module records (kiln/compiler/node_meta.py), which post-grad
    passes of compiles after start-up match the model's modules by: the rotary embedding's nodes among them."""
    from kiln.compiler import saved_capture

    saved = saved_capture.load(unpack(next(compile_root(cache_dir).rglob(CAPTURE)).read_bytes()))
    records = [stack for child in saved.split_module.children() if isinstance(child, torch.fx.GraphModule)
               for node in child.graph.nodes if (stack := node.meta.get("nn_module_stack"))]
    assert any(cls == "kiln.models.layers.RotaryEmbedding" for stack in records for _, cls in stack.values())


def test_disabled_cache_compiles(cold: Runtime, checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                 kernel_warmups: list[int]) -> None:
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    before = len(kernel_warmups)
    stats = Runtime(str(checkpoint), **OPTIONS).compile_stats
    assert stats.inductor_compiles == 3 and stats.cache_key is None and stats.cache_hits == 0
    assert len(kernel_warmups) == before + 1  # no cache to tell a warm start: the warm-up always runs


def test_concurrent_warmups(tmp_path: Path) -> None:
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "unused")}
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)
    cmd = [sys.executable, "-m", "kiln", "warmup", "tiny-llama", "-O1", "--device", "cpu",
           "--max-num-batched-tokens", "32", "--cache-dir", str(tmp_path / "cache")]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert "inductor_compiles=" in out
    compiles = sorted(int(out.split("inductor_compiles=")[1].split()[0]) for out, _ in outs)
    assert compiles[0] == 0  # one filled the key, the other waited for it and loaded
    verify = subprocess.run([sys.executable, "-m", "kiln", "cache", "--cache-dir", str(tmp_path / "cache"),
                             "verify"], cwd=REPO, env=env, capture_output=True, text=True)
    assert verify.returncode == 0 and "3 ok, 0 bad" in verify.stdout
    assert len(list((tmp_path / "cache").rglob(READY))) == 1
