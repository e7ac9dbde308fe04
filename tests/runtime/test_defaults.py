"""Per-device defaults (max_num_seqs, max_num_batched_tokens, async scheduling), resolved once at engine start.

The values are the measured choices of docs/BENCHMARKS.md ("Defaults"); these tests pin how they resolve:
None takes the device's default, anything explicit is kept, async scheduling is on exactly where it is
supported and helps (a GPU), and the reason is logged when it is off.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import Runtime
from kiln.config import DEVICE_DEFAULTS, CompilationConfig, SchedulerConfig, resolve_device

GPU, CPU = torch.device("cuda"), torch.device("cpu")  # a device object needs no CUDA to exist


def test_gpu_defaults_batch_256_sequences_overlapped() -> None:
    resolved = SchedulerConfig().resolve(GPU)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.async_scheduling) == (256, 8192, True)
    assert resolved.max_num_seqs >= 256


def test_cpu_defaults_stay_small_and_synchronous(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        resolved = SchedulerConfig().resolve(CPU)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.async_scheduling) == (64, 2048, False)
    assert any("async scheduling off" in r.message and "CPU" in r.message for r in caplog.records)


def test_tensor_parallel_keeps_the_device_defaults() -> None:
    """Workers receive rank 0's sampled ids on the device (docs/distributed.md), so TP overlaps as well."""
    default = SchedulerConfig().resolve(GPU)
    assert default.async_scheduling is True
    assert default.max_num_seqs == DEVICE_DEFAULTS["cuda"]["max_num_seqs"]


def test_explicit_values_win_on_every_device() -> None:
    explicit = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, async_scheduling=False)
    for device in (GPU, CPU):
        assert explicit.resolve(device) == explicit
    assert SchedulerConfig(async_scheduling=True).resolve(CPU).async_scheduling is True  # supported, just no gain
    resolved = SchedulerConfig(max_num_seqs=512).resolve(GPU)
    assert resolved.resolve(GPU) == resolved  # idempotent: a resolved config passes through unchanged


def test_bad_explicit_values_name_the_field() -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: 0})


def test_gpu_graphs_cover_every_decode_batch_of_the_default() -> None:
    """With the GPU budget, capture sizes stop at max_cudagraph_capture_size and include max_num_seqs, so a
    full decode batch (one token per sequence) replays a graph instead of running eagerly."""
    sched = SchedulerConfig().resolve(GPU)
    compiled = CompilationConfig(level=1).resolve(GPU, sched.max_num_batched_tokens)
    sizes = compiled.cudagraph_capture_sizes
    assert max(sizes) == min(CompilationConfig().max_cudagraph_capture_size, sched.max_num_batched_tokens)
    assert sched.max_num_seqs in sizes


def test_the_engine_resolves_its_config_before_building(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("tiny-llama")[0])
    runtime = Runtime(path, level=0, device="cpu", kv_cache_bytes=8 << 20)
    engine = runtime.engine
    assert runtime.config.scheduler.max_num_seqs is None  # what the user asked for stays as asked
    assert (engine.config.scheduler.max_num_seqs, engine.config.scheduler.max_num_batched_tokens) == (64, 2048)
    assert engine.runner.max_num_seqs == 64 and engine.runner.max_num_tokens == 2048
    assert engine.async_scheduling is False
    overlapped = Runtime(path, level=0, device="cpu", kv_cache_bytes=8 << 20, async_scheduling=True)
    assert overlapped.engine.async_scheduling is True


def test_a_kv_cache_larger_than_memory_names_the_option(tiny_checkpoint) -> None:
    """An explicit budget no allocator can give (a petabyte) is the user's number to fix, not a crash."""
    path = str(tiny_checkpoint("tiny-llama")[0])
    with pytest.raises(ValueError, match="kv_cache_bytes / num_blocks: a KV cache of .* blocks does not fit"):
        Runtime(path, level=0, device="cpu", kv_cache_bytes=10**15)


@pytest.mark.parametrize("asked", ["auto", "cuda", "cuda:1"])
def test_a_cuda_device_always_has_an_index(monkeypatch: pytest.MonkeyPatch, asked: str) -> None:
    """`torch.cuda.set_device` refuses an index-less device: `kiln serve --device auto` failed on an H200 with
    "Expected a torch.device with a specified index" until resolve_device named the current device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = resolve_device(asked)
    assert device.type == "cuda" and device.index == (1 if asked == "cuda:1" else 0)
    assert resolve_device("cpu") == CPU
