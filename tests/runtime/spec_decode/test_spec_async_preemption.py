"""n-gram speculation under async scheduling with a KV pool small enough to preempt, on a tiny random model: every
way a verify step launches (behind the step in flight, on the lookup's guess, after a missed guess's drain) meets
preemption and chunked prefills, and the greedy tokens stay those of the same runtime without speculation, with
no block left held."""

from __future__ import annotations

import random

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import assert_pool_clean

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# ~20 blocks of 16 tokens for tiny-qwen3: 8 running requests of up to ~100 tokens do not fit at once
OPTIONS = dict(level=0, device="cpu", max_num_batched_tokens=64, max_num_seqs=8, kv_cache_bytes=110_000)


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that repeat a short pattern (the lookup finds proposals), some with a random tail."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(24):
        pattern = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
        prompts.append((pattern * 10)[: rng.randint(5, 60)] + [rng.randrange(256) for _ in range(rng.randint(0, 5))])
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("seed", [5, 6])
def test_greedy_tokens_unchanged_through_preemption(seed: int) -> None:
    prompts, params = workload(seed)
    plain = Runtime("tiny-qwen3", **OPTIONS)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    runtime = Runtime("tiny-qwen3", async_scheduling=True, speculative_config=NGRAM, **OPTIONS)
    got = [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]
    assert got == want
    stats, engine = runtime.engine.stats, runtime.engine
    assert stats.verify_behind_steps > 0 and stats.verify_on_guess_steps > 0 and stats.guesses_missed > 0, stats
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(runtime)


class DummyBatchSwap:
    """Stands in for background compiles that finish at every step boundary: each swap captures graphs again, which
    runs dummy batches through the runner's input buffers, as `kiln.compiler.cuda_graphs.recapture` does."""

    def __init__(self, runner) -> None:
        self.runner, self.swaps = runner, 0

    def swap_if_done(self) -> bool:
        for size in (1, 4):
            self.runner.run_model(self.runner.to_device(self.runner.dummy_shape(size, decode=True), []))
        self.swaps += 1
        return True

    def cancel(self) -> None:
        pass


def test_a_swap_waits_for_a_step_whose_inputs_are_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step prepared on the lookup's guess has its inputs on the device before it launches; a background
    swap there would overwrite them with its captures' dummy batches, so it waits for the next boundary: the greedy
    tokens stay those of the runtime without speculation."""
    from types import SimpleNamespace

    prompts, params = workload(5)
    plain = Runtime("tiny-qwen3", **OPTIONS)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    runtime = Runtime("tiny-qwen3", async_scheduling=True, speculative_config=NGRAM, **OPTIONS)
    swap = DummyBatchSwap(runtime.engine.runner)
    monkeypatch.setattr(runtime.engine.worker, "compiled", SimpleNamespace(background=swap))
    got = [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]
    assert runtime.engine.stats.verify_on_guess_steps > 0 and swap.swaps > 0
    assert got == want
