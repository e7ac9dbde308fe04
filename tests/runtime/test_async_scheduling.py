"""Overlapped ("async") scheduling: the same tokens as synchronous stepping, and the overlap really happens.

One runtime per configuration, switched between modes with `engine.async_scheduling` (allowed between
steps), so each comparison runs the same weights and cache sizes both ways. Every async run also asserts
that steps were launched while another was in flight, so a silent fall-back to sync would fail.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from kiln import Runtime, SamplingParams
from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs
from kiln.runtime.runtime import build_config
from tests.conftest import add_mixed_requests, assert_pool_clean, cpu_runtime, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny-llama")


def make(checkpoint, **kwargs) -> Runtime:
    return cpu_runtime(checkpoint, async_scheduling=True, **kwargs)


@pytest.fixture(scope="module")
def runtime(checkpoint) -> Runtime:
    return make(checkpoint, max_num_batched_tokens=256, max_num_seqs=32)


def generate(runtime: Runtime, prompts, params, overlapped: bool) -> list:
    engine = runtime.engine
    engine.async_scheduling = overlapped
    before = engine.stats.overlapped_steps
    try:
        outs = runtime.generate(prompts, params)
    finally:
        engine.async_scheduling = True
    overlaps = engine.stats.overlapped_steps - before
    assert overlaps > 0 if overlapped else overlaps == 0
    return outs


def summary(outs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def assert_same(runtime: Runtime, prompts, params) -> list:
    """Sync first, then async; returns the outputs (async) after checking they are identical."""
    sync = generate(runtime, prompts, params, overlapped=False)
    overlapped = generate(runtime, prompts, params, overlapped=True)
    assert summary(overlapped) == summary(sync)
    assert_pool_clean(runtime)
    return overlapped


def mixed_params(n: int, seed: int, **kwargs) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True, **kwargs)
            for _ in range(n)]


def test_mixed_batch_matches_sync(runtime) -> None:
    rng = random.Random(1)
    prompts = random_prompts([rng.randint(1, 80) for _ in range(16)], 256, seed=21)
    outs = assert_same(runtime, prompts, mixed_params(16, seed=2))
    assert {len(o.outputs[0].token_ids) for o in outs} != {20}  # lengths really were mixed


def test_streaming_deltas_add_up(runtime) -> None:
    prompt = random_prompts([12], 256, seed=22)[0]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    final = runtime.generate([prompt], params)[0].outputs[0].token_ids
    deltas = [t for out in runtime.stream(prompt, params) for t in out.outputs[0].delta_token_ids]
    assert deltas == final
    assert_pool_clean(runtime)


def test_stop_token_ids_and_eos_mid_batch(runtime) -> None:
    prompts = random_prompts([5, 30, 9, 17, 44, 3, 25, 12], 256, seed=23)
    base = [o.outputs[0].token_ids for o in generate(runtime, prompts, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True), overlapped=False)]
    # stop each request on a token it really produces early on, so the stop cuts the run short
    params = [SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[toks[i % 5 + 1]])
              for i, toks in enumerate(base)]
    outs = assert_same(runtime, prompts, params)
    for toks, out in zip(base, outs):
        assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) < 16
        assert out.outputs[0].token_ids == toks[: len(out.outputs[0].token_ids)]
    engine = runtime.engine
    saved = engine.eos_token_ids, engine.runner.eos_token_ids
    try:  # make a token the first request emits at step 3 the model's EOS
        engine.eos_token_ids = engine.runner.eos_token_ids = frozenset([base[0][2]])
        outs = assert_same(runtime, prompts, SamplingParams(max_tokens=16, temperature=0.0))
        assert outs[0].outputs[0].finish_reason == "stop" and len(outs[0].outputs[0].token_ids) <= 3
    finally:
        engine.eos_token_ids, engine.runner.eos_token_ids = saved


def test_chunked_prefill(checkpoint, runtime) -> None:
    chunked = make(checkpoint, max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=8)
    prompts = random_prompts([45, 3, 20, 33, 1, 60], 256, seed=24)
    params = mixed_params(6, seed=3)
    outs = assert_same(chunked, prompts, params)
    assert summary(outs) == summary(runtime.generate(prompts, params))  # chunking changes nothing either


def test_preemption(checkpoint, runtime) -> None:
    # 12 usable blocks of 16 tokens; four requests that grow to 61..85 tokens cannot all stay resident
    tight = make(checkpoint, max_num_batched_tokens=64, num_blocks=13)
    prompts = random_prompts([21, 45, 30, 25], 256, seed=25)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sched = tight.engine.scheduler
    tight.generate(prompts, params)  # async (the default of this runtime)
    preempted = sched.num_preemptions
    assert preempted > 0
    outs = assert_same(tight, prompts, params)
    assert sched.num_preemptions > preempted * 2  # preempted in both the sync and the async run
    assert summary(outs) == summary(runtime.generate(prompts, params))


def test_prefix_cache_hits_on_generated_tokens(checkpoint, runtime) -> None:
    prompt = random_prompts([20], 256, seed=26)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = generate(runtime, [prompt], params, overlapped=True)[0].outputs[0].token_ids
    assert first == hf_greedy(checkpoint[1], prompt, 40)
    # blocks full of generated tokens were published while those tokens were in flight: their hashes
    # must cover the real tokens, so a continuation hits them and still matches the reference
    follow = prompt + first[:30]
    hits = runtime.engine.kv.hits
    out = generate(runtime, [follow], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                   overlapped=True)[0]
    assert out.num_cached_tokens == 48 and runtime.engine.kv.hits > hits
    assert out.outputs[0].token_ids == hf_greedy(checkpoint[1], follow, 8)
    shared = [prompt + p for p in random_prompts([5, 17, 40, 2], 256, seed=27)]
    assert_same(runtime, shared, mixed_params(4, seed=4))


def test_n_and_seeded_sampling(runtime) -> None:
    prompts = random_prompts([12, 30, 7], 256, seed=28)
    params = [SamplingParams(n=2, max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(n=3, max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=11, ignore_eos=True)]
    outs = assert_same(runtime, prompts, params)
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
    assert len({tuple(c.token_ids) for c in outs[1].outputs}) > 1


def test_penalties_drain_and_min_tokens_do_not(runtime) -> None:
    prompts = random_prompts([10, 25, 8, 40], 256, seed=29)
    base = [o.outputs[0].token_ids for o in runtime.generate(prompts, SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))]
    # min_tokens only needs the count of tokens in flight, not their values: it overlaps
    held = [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5, stop_token_ids=[toks[0], toks[3]])
            for toks in base]
    outs = assert_same(runtime, prompts, held)
    assert all(len(o.outputs[0].token_ids) >= 5 for o in outs)
    # penalties read the previous tokens' values: every step with a penalised request drains first. This
    # prompt's greedy run starts with a repeat, which a penalty that missed the token in flight would allow.
    engine = runtime.engine
    repeats = random_prompts([5], 256, seed=103)[0]
    first, second = runtime.generate([repeats], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids
    assert first == second
    penalised = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=3.0),
                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                                frequency_penalty=0.5)]
    sync = generate(runtime, [repeats, repeats], penalised, overlapped=False)
    engine.async_scheduling = True
    before = engine.stats.overlapped_steps
    assert summary(runtime.generate([repeats, repeats], penalised)) == summary(sync)
    assert engine.stats.overlapped_steps == before
    assert all(len(set(o.outputs[0].token_ids)) == 12 for o in sync)
    prompts = [repeats] + prompts[1:]
    # mixed with plain requests that outlive them, the overlap resumes once the penalised ones finish
    mixed = penalised + [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 2
    assert_same(runtime, prompts, mixed)


def test_logprobs(runtime) -> None:
    prompts = random_prompts([15, 4, 33], 256, seed=30)
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, logprobs=0, ignore_eos=True)]
    sync = generate(runtime, prompts, params, overlapped=False)
    overlapped = assert_same(runtime, prompts, params)
    for a, b in zip(sync, overlapped):
        if a.outputs[0].logprobs is None:
            assert b.outputs[0].logprobs is None
            continue
        # fp32 sums differ in the last bits with batch shape (async batches also hold requests just finished)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert (x.sampled.token_id, x.sampled.rank) == (y.sampled.token_id, y.sampled.rank)
            assert x.sampled.logprob == pytest.approx(y.sampled.logprob, abs=1e-4)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            assert [t.logprob for t in x.top] == pytest.approx([t.logprob for t in y.top], abs=1e-4)


def test_abort_in_flight_and_no_block_leak(checkpoint) -> None:
    runtime = make(checkpoint, max_num_batched_tokens=96, num_blocks=40, max_num_seqs=16)
    engine = runtime.engine
    ids, rng = add_mixed_requests(engine, 200, seed=31, stop_tokens=True)
    finished = aborted = 0
    live = set(ids)
    in_flight_aborts = 0
    while engine.has_unfinished():
        if rng.random() < 0.3 and live:
            victim = rng.choice(sorted(live))
            inflight = engine._inflight
            if inflight is not None and any(r.request_id.partition("#")[0] == victim for r in inflight.sched.requests):
                in_flight_aborts += 1
            aborted += engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            assert out.request_id in live  # nothing is reported for a request after its abort
            if out.finished:
                finished += 1
                live.discard(out.request_id)
    assert aborted > 10 and finished > 10 and aborted + finished == 200
    assert in_flight_aborts > 5 and engine.stats.overlapped_steps > 50
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(runtime)
    assert engine.step() == [] and engine._inflight is None  # a stale in-flight step drains to nothing
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks[1:])


def test_server_engine_loop(runtime) -> None:
    from kiln.entrypoints.server.async_engine import AsyncEngine

    prompts = random_prompts([7, 20, 33], 256, seed=33)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in generate(runtime, prompts, params, overlapped=False)]
    engine = runtime.engine
    before = engine.stats.overlapped_steps

    async def collect(stream) -> list[int]:
        return [t async for out in stream for t in out.outputs[0].delta_token_ids]

    async def main() -> list[list[int]]:
        server = AsyncEngine(engine)
        server.start()
        try:
            streams = [await server.add_request(f"s{i}", p, params) for i, p in enumerate(prompts)]
            victim = await server.add_request("victim", prompts[0], SamplingParams(max_tokens=200, ignore_eos=True))
            await victim.next()
            server.abort("victim")  # most likely while one of its steps is in flight
            return list(await asyncio.gather(*(collect(s) for s in streams)))
        finally:
            await server.shutdown()

    assert asyncio.run(main()) == expected
    assert engine.stats.overlapped_steps > before
    assert_pool_clean(runtime)


def test_compiled_O2(checkpoint) -> None:
    compiled = make(checkpoint, level=2, compile_sizes=(), max_num_batched_tokens=32, max_num_seqs=8)
    rng = random.Random(5)
    prompts = random_prompts([rng.randint(1, 50) for _ in range(8)], 256, seed=32)
    outs = assert_same(compiled, prompts, mixed_params(8, seed=6))
    assert outs[2].outputs[0].token_ids == hf_greedy(checkpoint[1], prompts[2], len(outs[2].outputs[0].token_ids))


@pytest.mark.slow
def test_stop_strings_on_the_embedded_model(embedded_dir) -> None:
    runtime = Runtime(str(embedded_dir), level=0, device="cpu", dtype="fp32", async_scheduling=True)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "List three colours."}],
             [{"role": "user", "content": "Write a haiku about the sea."}]]
    prompts = [runtime.apply_chat_template(c) for c in chats]
    full = generate(runtime, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                    overlapped=False)
    # stop on a word each answer really contains after its first few tokens, so the stop cuts it short
    stops = [next(w for w in o.outputs[0].text.split()[3:] if len(w) > 3) for o in full]
    params = [SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]) for stop in stops]
    outs = assert_same(runtime, prompts, params)
    for out, stop, whole in zip(outs, stops, full):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.outputs[0].text == whole.outputs[0].text[: whole.outputs[0].text.index(stop)]


def test_flag_plumbing() -> None:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    assert runtime_kwargs(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert runtime_kwargs(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert "async_scheduling" not in runtime_kwargs(parser.parse_args([]))
    assert build_config(async_scheduling=True).scheduler.async_scheduling is True
    assert build_config().scheduler.async_scheduling is None  # per device, resolved at engine start
