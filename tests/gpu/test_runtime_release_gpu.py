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
