"""A runtime the caller drops gives its GPU memory back: a second runtime in the same process, at the default
memory budget, gets a KV cache (a benchmark that profiled SmolLM2-135M and then Llama-3-8B in one process found a
budget of 0 bytes for the second on the H200). Skipped without a GPU."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from kiln import Runtime, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _holders(obj: object, depth: int = 3) -> list[str]:
    """Who still refers to `obj`, a few levels up (the failure message: what to release)."""
    lines, frontier, seen = [], [obj], {id(obj)}
    for level in range(depth):
        nxt = []
        for target in frontier:
            for ref in gc.get_referrers(target):
                if id(ref) in seen or isinstance(ref, types.FrameType) or ref is frontier or ref is nxt:
                    continue
                seen.add(id(ref))
                nxt.append(ref)
                lines.append(f"{'  ' * level}{type(ref).__module__}.{type(ref).__qualname__}: {str(ref)[:120]}")
        frontier = nxt[:12]
    return lines


def test_a_dropped_runtime_frees_its_memory_for_the_next() -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = Runtime("smollm2-135m", load_format="dummy")
    expected = first.generate([[1, 2, 3, 4]], greedy)[0].outputs[0].token_ids
    model = weakref.ref(first.engine.worker.model)
    first.engine.shutdown()
    del first
    gc.collect()
    if model() is not None:
        pytest.fail("the model outlived its runtime; held by:\n" + "\n".join(_holders(model())))
    torch.cuda.empty_cache()
    second = Runtime("smollm2-135m", load_format="dummy")  # a budget of 0 bytes would raise here
    assert second.generate([[1, 2, 3, 4]], greedy)[0].outputs[0].token_ids == expected
    second.engine.shutdown()


def test_a_runtime_dropped_without_shutdown_leaves_the_next_its_budget() -> None:
    """No shutdown, no empty_cache: the dropped runtime's KV cache sits in torch's cache as one block, which the
    next runtime's larger weights were cut out of, so its sizing counted the whole block as in use (a budget of 0
    bytes at gpu_memory_utilization=0.3 on an H100). The second must get about the first's KV bytes."""
    def kv_bytes(runtime: Runtime) -> int:
        cache = runtime.engine.worker.kv_cache
        return cache.numel() * cache.element_size()

    common = dict(level=0, device="cuda", gpu_memory_utilization=0.3)
    first = Runtime("tiny-llama", dtype="fp32", **common)
    dropped = kv_bytes(first)
    del first
    second = Runtime("smollm2-135m", dtype="bf16", load_format="dummy", **common)
    assert kv_bytes(second) >= 0.9 * dropped, (kv_bytes(second), dropped)
    second.engine.shutdown()
