"""Speculative decoding on the embedded SmolLM2-135M at -O2 (fp32, CPU): the same greedy tokens with and without
it, for n-gram proposals and a draft model (the embedded model drafting for itself, so every greedy proposal
must be accepted), requests that run to max_tokens, hit EOS, stop strings and short limits inside an accepted
run, logprobs, seeded sampling, and preemption while proposals are in flight.

One runtime serves every test (a compile at -O2 per model is the cost here): it is built with the draft model,
and `speculating` swaps the proposer (or turns speculation off) between requests, as the engine allows."""

from __future__ import annotations

import contextlib
import re

import pytest

from kiln import Runtime, SamplingParams, StructuredOutputsParams
from kiln.runtime.spec_decode.ngram import NgramProposer

pytestmark = pytest.mark.slow

TEXT = ("The lighthouse keeper climbed the stairs every evening at six. He lit the lamp, wound the clock, and "
        "wrote one line in the log: all quiet on the water tonight.")
K = 4


@pytest.fixture(scope="module")
def runtime(embedded_dir, tmp_path_factory) -> Runtime:
    with pytest.MonkeyPatch.context() as env:
        # the draft is the same model at the same settings: its compile-cache key is the target's, so with the
        # cache on (in a directory of its own) it loads what the target compiled instead of compiling again
        env.setenv("KILN_DISABLE_COMPILE_CACHE", "0")
        env.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("kiln-cache")))
        rt = Runtime(str(embedded_dir), level=2, device="cpu", dtype="fp32", max_num_batched_tokens=256,
                     max_num_seqs=8, speculative_config={"method": "draft_model", "model": str(embedded_dir),
                                                         "num_speculative_tokens": K})
    assert rt.engine.speculation.proposer.worker.compile_stats.inductor_compiles == 0
    yield rt
    rt.shutdown()


@contextlib.contextmanager
def speculating(rt: Runtime, method: str | None):
    """method: "draft" (the configured draft model), "ngram", "ngram-padded" (short proposals filled up to k, as
    with FULL verify graphs on a GPU), or None (off)."""
    engine = rt.engine
    spec = engine.speculation
    draft = spec.proposer
    if method in ("ngram", "ngram-padded"):
        spec.proposer = NgramProposer(K, 1, 4)
    spec.pad_proposals = method == "ngram-padded"
    engine.speculation = spec if method else None
    try:
        yield spec
    finally:
        spec.proposer, engine.speculation, spec.pad_proposals = draft, spec, False


def prompts(rt: Runtime) -> list[list[int]]:
    chat = rt.apply_chat_template
    return [chat([{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT}"}]),
            chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}]),
            chat([{"role": "user", "content": f"Copy this sentence: {TEXT[:60]}"}])]


PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),  # runs to max_tokens
          SamplingParams(max_tokens=32, temperature=0.0),  # ends at EOS
          SamplingParams(max_tokens=24, temperature=0.0, stop=["keeper"]),  # a stop string inside a run
          SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]  # a limit inside a run


def generate(rt: Runtime, method: str | None):
    ps = prompts(rt)
    with speculating(rt, method) as spec:
        before = dict(spec.stats.as_dict())
        outs = rt.generate(ps + [ps[0]], PARAMS)
        after = spec.stats.as_dict()
    return [o.outputs[0] for o in outs], {k: after[k] - before[k] for k in ("spec_decode_num_draft_tokens",
                                                                              "spec_decode_num_accepted_tokens")}


@pytest.fixture(scope="module")
def plain(runtime):
    return generate(runtime, None)[0]


def test_reference_covers_every_ending(plain) -> None:
    assert [o.finish_reason for o in plain] == ["length", "stop", "stop", "length"]
    assert plain[1].stop_reason is None and plain[2].stop_reason == "keeper"
    assert len(plain[0].token_ids) == 24 and len(plain[3].token_ids) == 7


@pytest.mark.parametrize("method", ["ngram", "ngram-padded", "draft"])
def test_greedy_tokens_unchanged(runtime, plain, method) -> None:
    outs, counts = generate(runtime, method)
    for got, want in zip(outs, plain):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert counts["spec_decode_num_accepted_tokens"] > 0
    if method == "draft":  # the model drafting for itself: the target's greedy token is the draft's every time
        assert counts["spec_decode_num_accepted_tokens"] == counts["spec_decode_num_draft_tokens"]


def test_ngram_with_async_scheduling_overlaps_plain_and_verify_steps(runtime, plain) -> None:
    """n-gram under async scheduling: a step whose requests have no proposals launches overlapped, and a verify
    step launches behind the step in flight (its first input that step's token, the proposals looked up without
    it: at once while the request copies, else once that token matched the lookup's guess) or after draining it;
    the greedy tokens stay the plain ones, stops and limits inside an accepted run included."""
    engine = runtime.engine
    free = runtime.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}])
    free_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # alone, a copy that ends an accepted run, decodes a token with nothing to propose, then proposes again:
    # that proposal is verified behind the step in flight
    copy = runtime.apply_chat_template([{"role": "user", "content": f"Here is a paragraph:\n\n{TEXT}\n\nWrite "
                                                                    "the paragraph again, word for word."}])
    copy_params = SamplingParams(max_tokens=64, temperature=0.0)
    with speculating(runtime, None):
        want_free, want_copy = (runtime.generate([p], q)[0].outputs[0].token_ids
                                for p, q in ((free, free_params), (copy, copy_params)))
    engine.async_scheduling = True
    try:
        outs, counts = generate(runtime, "ngram")  # copy prompts: proposals nearly every step
        overlapped, behind = engine.stats.overlapped_steps, engine.stats.verify_behind_steps
        with speculating(runtime, "ngram") as spec:
            got_copy = runtime.generate([copy], copy_params)[0].outputs[0].token_ids
            behind = engine.stats.verify_behind_steps - behind
            got_free = runtime.generate([free], free_params)[0].outputs[0].token_ids
            guessed = engine.stats.verify_on_guess_steps
            spec.proposer = NgramProposer(K, 2, 4)  # two-token matches: the lookup's guesses hit while it copies
            got_copy_guessed = runtime.generate([copy], copy_params)[0].outputs[0].token_ids
            guessed = engine.stats.verify_on_guess_steps - guessed
    finally:
        engine.async_scheduling = False
    for got, want in zip(outs, plain):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert counts["spec_decode_num_accepted_tokens"] > 0
    assert got_copy == want_copy and behind > 0
    # a verify of a request not copying at the moment, prepared on the lookup's guess while its plain step ran
    assert got_copy_guessed == want_copy and guessed > 0
    assert got_free == want_free
    assert engine.stats.overlapped_steps > overlapped


def test_logprobs_inside_accepted_runs(runtime) -> None:
    prompt = prompts(runtime)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    with speculating(runtime, None):
        want = runtime.generate([prompt], params)[0].outputs[0]
    with speculating(runtime, "ngram") as spec:
        accepted = spec.stats.num_accepted_tokens
        got = runtime.generate([prompt], params)[0].outputs[0]
        assert spec.stats.num_accepted_tokens > accepted
    assert got.token_ids == want.token_ids and len(got.logprobs) == 10
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.sampled.token_id == b.sampled.token_id and a.sampled.rank == b.sampled.rank
        assert a.sampled.logprob == pytest.approx(b.sampled.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_seeded_sampling_reproduces(runtime) -> None:
    prompt = prompts(runtime)[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1234, ignore_eos=True)
    with speculating(runtime, "ngram"):
        first, second = (runtime.generate([prompt], params)[0].outputs[0].token_ids for _ in range(2))
    assert first == second


def test_preemption_mid_run(runtime, plain) -> None:
    """Take the pool's free blocks while speculating requests decode: the youngest are preempted (their
    proposals dropped) and recomputed, and every output is still the non-speculative one."""
    engine = runtime.engine
    ps = prompts(runtime)
    with speculating(runtime, "ngram"):
        ids = [engine.add_request(p, s) for p, s in zip(ps + [ps[0]], PARAMS)]
        outs = {}
        for _ in range(3):
            for out in engine.step():
                outs[out.request_id] = out
        preempted = engine.scheduler.num_preemptions
        held = engine.pool.allocate(engine.pool.num_free)  # no block left: the next request to need one preempts
        for _ in range(12):
            for out in engine.step():
                outs[out.request_id] = out
            held += engine.pool.allocate(engine.pool.num_free)  # what preemption and roll-back freed, too
            if engine.scheduler.num_preemptions > preempted:
                break
        assert engine.scheduler.num_preemptions > preempted
        engine.pool.free(held)
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
    for request_id, want in zip(ids, plain):
        assert outs[request_id].outputs[0].token_ids == want.token_ids


def test_a_constrained_request_beside_speculating_ones_stays_valid(runtime, plain) -> None:
    """A verify step samples without grammar masks, so nothing speculates while a constrained request is
    scheduled: its output obeys its regex and is the one it samples without speculation, the speculating
    request's output is unchanged, and speculation goes on around it."""
    ps = prompts(runtime)
    pattern = r"[A-Z][a-z]{2,6}-\d{2,3}"
    constrained = SamplingParams(max_tokens=12, temperature=0.8, seed=5,
                                 structured_outputs=StructuredOutputsParams(regex=pattern))
    with speculating(runtime, None):
        want = runtime.generate([ps[1]], constrained)[0].outputs[0]  # also compiles the grammar (a cache hit next)
    with speculating(runtime, "ngram") as spec:
        accepted = spec.stats.num_accepted_tokens
        outs = runtime.generate([ps[0], ps[1]], [PARAMS[0], constrained])
        assert spec.stats.num_accepted_tokens > accepted
    assert outs[0].outputs[0].token_ids == plain[0].token_ids
    got = outs[1].outputs[0]
    assert re.fullmatch(pattern, got.text) and got.token_ids == want.token_ids, got.text


def test_stats_report_speculation(runtime) -> None:
    stats = runtime.stats()
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == K
    assert not runtime.engine.async_scheduling
