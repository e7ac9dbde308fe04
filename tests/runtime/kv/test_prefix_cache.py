"""Automatic prefix caching through the engine: same tokens as without it, and only the rest is computed."""

from __future__ import annotations

import random

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import cpu_runtime, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny-qwen3")


def make(checkpoint, caching: bool, **kwargs) -> Runtime:
    return cpu_runtime(checkpoint, enable_prefix_caching=caching, **kwargs)


def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = random_prompts([prefix_len], 256, seed=seed)[0]
    return [prefix + random_prompts([rng.randint(1, 40)], 256, seed=seed * 100 + i)[0] for i in range(n)]


@pytest.mark.parametrize("kwargs", [
    {"max_num_batched_tokens": 256},
    {"max_num_batched_tokens": 24},  # chunked prefill
    {"max_num_batched_tokens": 64, "num_blocks": 14},  # preemption
    {"max_num_batched_tokens": 24, "level": 2, "compile_sizes": ()},  # compiled, chunked
], ids=["plain", "chunked", "preempted", "compiled-O2"])
def test_caching_does_not_change_greedy_output(checkpoint, kwargs) -> None:
    prompts = shared_prefix_prompts(8, 70, seed=1)
    on, off = make(checkpoint, True, **kwargs), make(checkpoint, False, **kwargs)
    params = SamplingParams(max_tokens=40 if "num_blocks" in kwargs else 10, temperature=0.0, ignore_eos=True)
    # in two waves, so the second wave finds the first wave's blocks cached
    for wave in (prompts[:4], prompts[4:]):
        expected = [o.outputs[0].token_ids for o in off.generate(wave, params)]
        assert [o.outputs[0].token_ids for o in on.generate(wave, params)] == expected
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0 and off.stats()["prefix_cache_hits"] == 0
    if "num_blocks" in kwargs:
        assert stats["preemptions"] > 0


def test_fully_cached_prompt_computes_exactly_one_token(checkpoint) -> None:
    rt = make(checkpoint, True)
    prompt = random_prompts([48], 256, seed=2)[0]  # exactly 3 full blocks
    one = SamplingParams(max_tokens=1, temperature=0.0)
    first = rt.generate([prompt], one)[0]
    before = rt.stats()["scheduled_tokens"]
    second = rt.generate([prompt], one)[0]
    assert rt.stats()["scheduled_tokens"] - before == 1
    assert second.num_cached_tokens == 47
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # a longer continuation of the same prompt reuses all 3 blocks and computes the rest
    longer = rt.generate([prompt + [7, 8, 9]], one)[0]
    assert longer.num_cached_tokens == 48


def test_salts_namespace_the_cache(checkpoint) -> None:
    rt = make(checkpoint, True)
    prompt = random_prompts([40], 256, seed=3)[0]

    def cached(salt: str | None) -> int:
        return rt.generate([prompt], SamplingParams(max_tokens=2, cache_salt=salt))[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") == 32 and cached("tenant-b") == 32 and cached(None) == 32


def test_no_block_leak_after_500_requests_with_shared_prefixes(checkpoint) -> None:
    rt = make(checkpoint, True, num_blocks=48, max_num_seqs=24, max_num_batched_tokens=128)
    engine = rt.engine
    rng = random.Random(5)
    prefixes = [random_prompts([rng.randint(8, 60)], 256, seed=50 + i)[0] for i in range(6)]
    for i in range(500):
        prompt = rng.choice(prefixes) + random_prompts([rng.randint(1, 20)], 256, seed=1000 + i)[0]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0,
                                                  cache_salt=rng.choice([None, None, "s"])))
        if i % 7 == 0:
            engine.step()
        if i % 50 == 0 and engine.parents:
            engine.abort(next(iter(engine.parents)))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_allocated_requests == 0
    assert engine.pool.num_free == engine.pool.num_usable
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks[1:])
    assert rt.stats()["prefix_cache_hit_rate"] > 0.2
