"""Engine behaviour on a tiny random Llama (fp32, eager): invariance, sampling, stops, leaks, validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import add_mixed_requests, assert_pool_clean, hf_greedy, random_prompts
from tests.conftest import cpu_runtime as make

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("tiny-llama")


@pytest.fixture(scope="module")
def runtime(checkpoint) -> Runtime:
    return make(checkpoint, max_num_batched_tokens=256)


def test_output_invariant_to_batching_chunking_and_preemption(checkpoint, runtime) -> None:
    target = random_prompts([45], 256, seed=7)[0]
    others = random_prompts([5, 60, 1, 33, 17, 90, 2, 48, 11, 70, 25, 8, 39, 64, 3], 256, seed=8)
    alone = runtime.generate([target], GREEDY)[0].outputs[0].token_ids
    assert alone == hf_greedy(checkpoint[1], target, 12)

    batched = runtime.generate(others[:7] + [target] + others[7:], GREEDY)
    assert batched[7].outputs[0].token_ids == alone

    chunked_rt = make(checkpoint, max_num_batched_tokens=7)
    chunked = chunked_rt.generate([target] + others[:5], GREEDY)
    assert chunked[0].outputs[0].token_ids == alone
    assert chunked_rt.engine.stats.steps > 45 // 7  # the prompt really was split over steps

    # 12 usable blocks of 16 tokens; four requests that grow to 61..85 tokens cannot all stay resident
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    group = [others[1][:21], target, others[4][:30], others[9][:25]]
    tight = make(checkpoint, max_num_batched_tokens=64, num_blocks=13)
    outs = tight.generate(group, long)
    assert tight.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(group, outs):
        assert out.outputs[0].token_ids == runtime.generate([prompt], long)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids[:12] == alone
    assert_pool_clean(tight)


def test_requests_beyond_the_context_are_refused_naming_the_field(checkpoint) -> None:
    """prompt + max_tokens > max_model_len and n > max_n are ValueErrors stating the numbers; max_tokens=None
    is the rest of the context (the same tokens as asking for exactly that many, and transformers')."""
    rt = make(checkpoint, max_model_len=48, max_n=3)
    prompt = random_prompts([20], 256, seed=5)[0]
    greedy = dict(temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^max_tokens 29 plus the prompt's 20 tokens is 49 tokens.*48"):
        rt.generate([prompt], SamplingParams(max_tokens=29, **greedy))
    with pytest.raises(ValueError, match=r"^n 4 .*3 .*max_n"):
        rt.generate([prompt], SamplingParams(max_tokens=2, n=4, **greedy))
    with pytest.raises(ValueError, match="max_n"):
        make(checkpoint, max_n=0)
    assert_pool_clean(rt)
    exact = rt.generate([prompt], SamplingParams(max_tokens=28, **greedy))[0].outputs[0]
    rest = rt.generate([prompt], SamplingParams(max_tokens=None, **greedy))[0].outputs[0]
    assert exact.token_ids == hf_greedy(checkpoint[1], prompt, 28)
    assert rest.token_ids == exact.token_ids and rest.finish_reason == "length"
    assert len(rt.generate([prompt], SamplingParams(max_tokens=2, n=3, **greedy))[0].outputs) == 3
    assert_pool_clean(rt)
    small = make(checkpoint, num_blocks=3)  # 2 usable blocks of 16 tokens: a request of up to 32 fits
    with pytest.raises(ValueError, match=r"^max_tokens too large for the KV cache: .* 36 tokens .* only 32"):
        small.generate([prompt], SamplingParams(max_tokens=16, **greedy))
    assert len(small.generate([prompt], SamplingParams(max_tokens=12, **greedy))[0].outputs[0].token_ids) == 12


def test_seeded_sampling_is_batch_independent(runtime) -> None:
    prompt = random_prompts([20], 256, seed=3)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = runtime.generate([prompt], params)[0].outputs[0].token_ids
    again = runtime.generate([prompt], params)[0].outputs[0].token_ids
    noise = [SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)] * 5
    batch = runtime.generate(random_prompts([4, 30, 9, 50, 12], 256, seed=4) + [prompt], noise + [params])
    assert alone == again == batch[-1].outputs[0].token_ids
    other_seed = runtime.generate([prompt], SamplingParams(max_tokens=10, seed=99, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples(runtime) -> None:
    prompt = random_prompts([12], 256, seed=5)[0]
    out = runtime.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = runtime.generate([prompt], SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert out.num_completion_tokens == 24


def test_logprobs_match_reference_log_softmax(checkpoint, runtime) -> None:
    hf = checkpoint[1]
    prompt = random_prompts([15], 256, seed=6)[0]
    out = runtime.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3,
                                                    ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert lp.sampled.token_id == token
        assert lp.sampled.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert lp.sampled.rank == 1
        top = torch.topk(row, 3)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8, "num_blocks": 64},
                                     {"max_num_batched_tokens": 8, "num_blocks": 64, "async_scheduling": True}],
                         ids=["one chunk", "chunked", "chunked, overlapped"])
def test_prompt_logprobs_match_transformers_teacher_forced(checkpoint, options) -> None:
    """prompt_logprobs=k: at each prompt position after the first, its token's logprob and rank and the top k, as
    transformers' log-softmax over the prompt gives them; in one chunk or in chunks of 8, beside a request without
    them (whose tokens do not change), and again for a prompt whose blocks are in the prefix cache (scored anew:
    cached positions would have no logits)."""
    runtime = make(checkpoint, **options)
    prompts = random_prompts([21, 9], 256, seed=14)
    with torch.no_grad():
        ref = torch.log_softmax(checkpoint[1](torch.tensor([prompts[0]])).logits[0].float(), dim=-1)
    plain = runtime.generate([prompts[1]], GREEDY)[0].outputs[0].token_ids
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    for _ in range(2):  # the second time the prompt's blocks are cached
        outs = runtime.generate(prompts, [scored, GREEDY])
        got = outs[0].prompt_logprobs
        assert outs[1].prompt_logprobs is None and outs[1].outputs[0].token_ids == plain
        assert len(got) == len(prompts[0]) and got[0] is None
        for pos, entry in enumerate(got[1:], start=1):
            row, token = ref[pos - 1], prompts[0][pos]
            assert entry.sampled.token_id == token
            assert entry.sampled.logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry.sampled.rank == int((row > row[token]).sum()) + 1
            assert [t.token_id for t in entry.top] == torch.topk(row, 2).indices.tolist()
    assert outs[0].outputs[0].token_ids == hf_greedy(checkpoint[1], prompts[0], 4)
    assert_pool_clean(runtime)


def test_stop_token_ids_and_min_tokens(runtime) -> None:
    prompt = random_prompts([10], 256, seed=9)[0]
    base = runtime.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_at = base[2]
    out = runtime.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = base.index(stop_at)
    assert out.outputs[0].token_ids == base[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    first_tok = base[0]
    held = runtime.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[first_tok],
                                                     min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) >= 4 and first_tok not in held.token_ids[:4]
    length = runtime.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert length.outputs[0].finish_reason == "length" and len(length.outputs[0].token_ids) == 5


def test_logit_bias_matches_transformers_sequence_bias(checkpoint, runtime) -> None:
    """Greedy with a logit bias == transformers' generate with the same single-token sequence_bias (added to the
    logits before the argmax every step); in one batch with an unbiased request, which keeps its own tokens."""
    prompt = random_prompts([13], 256, seed=12)[0]
    base = runtime.generate([prompt], GREEDY)[0].outputs[0].token_ids
    bias = {base[1]: -100.0, 200: 2.5}
    biased = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=bias)
    outs = runtime.generate([prompt, prompt], [biased, GREEDY])
    hf = checkpoint[1].generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                                sequence_bias={(t,): b for t, b in bias.items()})[0, len(prompt):].tolist()
    assert outs[0].outputs[0].token_ids == hf and base[1] not in hf and hf != base
    assert outs[1].outputs[0].token_ids == base
    with pytest.raises(ValueError, match="^logit_bias token ids"):
        runtime.generate([prompt], SamplingParams(max_tokens=2, logit_bias={100000: 1.0}))
    assert_pool_clean(runtime)


def test_truncate_prompt_tokens_keeps_the_prompts_end(checkpoint, runtime) -> None:
    """truncate_prompt_tokens=k generates what the prompt's last k tokens alone generate (transformers' greedy on
    them); -1 keeps as many as leave room for one generated token, so a prompt past max_model_len still runs."""
    prompt = random_prompts([30], 256, seed=15)[0]
    out = runtime.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    truncate_prompt_tokens=11))[0]
    assert out.prompt_token_ids == prompt[-11:]
    assert out.outputs[0].token_ids == hf_greedy(checkpoint[1], prompt[-11:], 6)
    long = random_prompts([runtime.engine.max_model_len + 40], 256, seed=16)[0]
    kept = runtime.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert kept.prompt_token_ids == long[-(runtime.engine.max_model_len - 1):]
    assert len(kept.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="^allowed_token_ids token ids"):
        runtime.generate([prompt], SamplingParams(max_tokens=2, allowed_token_ids=[5, 100000]))
    with pytest.raises(ValueError, match="^stop_token_ids token ids"):
        runtime.generate([prompt], SamplingParams(max_tokens=2, stop_token_ids=[100000]))
    with pytest.raises(ValueError, match="^truncate_prompt_tokens .* max_model_len"):
        too_many = runtime.engine.max_model_len + 1
        runtime.generate([prompt], SamplingParams(max_tokens=2, truncate_prompt_tokens=too_many))
    assert_pool_clean(runtime)


def test_eos_stops_unless_ignored(checkpoint) -> None:
    runtime = make(checkpoint)
    prompt = random_prompts([10], 256, seed=9)[0]
    base = runtime.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # make the model's 2nd greedy token its EOS
    runtime.engine.eos_token_ids = runtime.engine.runner.eos_token_ids = frozenset([base[1]])
    out = runtime.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert out.token_ids == base[: base.index(base[1]) + 1] and out.finish_reason == "stop"
    assert runtime.generate([prompt], GREEDY)[0].outputs[0].token_ids == base


def test_no_block_leak_after_mixed_and_aborted_requests(checkpoint) -> None:
    runtime = make(checkpoint, max_num_batched_tokens=96, num_blocks=40, max_num_seqs=16)
    engine = runtime.engine
    ids, rng = add_mixed_requests(engine, 200, seed=11)
    finished = aborted = 0
    live = set(ids)
    while engine.has_unfinished():
        if rng.random() < 0.3 and live:
            victim = rng.choice(sorted(live))
            aborted += engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                finished += 1
                live.discard(out.request_id)
    assert aborted > 10 and finished > 10 and aborted + finished == 200
    assert_pool_clean(runtime)


def test_abort_waiting_request_frees_at_once(runtime) -> None:
    engine = runtime.engine
    rid = engine.add_request(random_prompts([40], 256)[0], GREEDY)
    engine.step()
    assert engine.kv.num_allocated_requests == 1
    assert engine.abort(rid) and not engine.abort(rid)
    assert_pool_clean(runtime)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**64 - 2, "n": 3}, "seed"),  # choice 2 would seed with 2**64
    ({"seed": -2**63 - 1}, "seed"),
    ({"stop_token_ids": [3, -5]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"bad_words": 5}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"),  # a lone surrogate: no character, the tokenizer refuses it
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),  # logits / inf: NaN rows
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"max_tokens": True}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_divide_by_samples_greedily(runtime) -> None:
    """1 / T past fp32's range turned every logit into inf or NaN (token 0 whatever the constraints): below 1e-5 a
    request samples greedily, as vLLM's does, and keeps its allowed_token_ids."""
    prompt = random_prompts([12], 256, seed=21)[0]
    greedy = runtime.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids
    tiny = SamplingParams(max_tokens=4, temperature=1e-40, seed=3)
    assert tiny.temperature == 0.0 and SamplingParams(temperature=1e-5).temperature == 1e-5
    assert runtime.generate([prompt], tiny)[0].outputs[0].token_ids == greedy
    vocab = runtime.engine.loaded.spec.vocab_size
    allowed = sorted({(greedy[0] + 1) % vocab, (greedy[0] + 2) % vocab})
    out = runtime.generate([prompt], SamplingParams(max_tokens=3, temperature=1e-40, allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    assert_pool_clean(runtime)


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": "4"}, {"max_num_seqs": 2.5}, {"max_num_seqs": True},
                                    {"gpu_memory_utilization": "0.5"}, {"level": True}, {"passes": "noop"},
                                    {"cudagraph_capture_sizes": 5}, {"async_scheduling": "yes"}, {"device": None},
                                    {"tokenizer": 123}, {"enable_expert_parallel": "no"}])
def test_runtime_options_of_the_wrong_type_name_the_option(kwargs) -> None:
    """A bool is not an int, "4" not a number, "noop" not a tuple of passes: a ValueError naming the option, not a
    TypeError deep in the build or a value taken as given."""
    from kiln.runtime.runtime import build_config

    (key,) = kwargs
    with pytest.raises(ValueError, match=f"^{key} must be "):
        build_config("tiny-llama", **kwargs)
    build_config("tiny-llama", gpu_memory_utilization=1, passes=["noop"], compile_sizes=[1, 2], tokenizer=Path("/x"))


def test_unknown_fields_and_bad_prompts_are_rejected(runtime) -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter.*bogus"):
        SamplingParams.from_dict({"max_tokens": 3, "bogus": 1})
    with pytest.raises(ValueError, match="empty"):
        runtime.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        runtime.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        runtime.generate([[5, 100000]], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        runtime.generate(["text needs a tokenizer"], GREEDY)
    with pytest.raises(ValueError, match="unknown Runtime option"):
        Runtime("tiny-llama", level=0, device="cpu", no_such_option=1)
    # a rejected batch leaves nothing queued, and the engine keeps working
    with pytest.raises(ValueError):
        runtime.generate([[5, 6, 7], []], GREEDY)
    assert_pool_clean(runtime)
    for bad in (None, 3.5, [[1, 2]], [1.5, 2.0], {"a": 1}):
        with pytest.raises(ValueError, match="^prompt"):
            runtime.generate([[5, 6, 7], [8, 9], bad], GREEDY)
        assert_pool_clean(runtime)
    assert runtime.generate([torch.tensor([5, 6, 7])], GREEDY)[0].prompt_token_ids == [5, 6, 7]
    # one prompt as a tensor, an array or numpy integers, as a list of ids is; a dict is not SamplingParams
    for one in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        assert [o.prompt_token_ids for o in runtime.generate(one, GREEDY)] == [[5, 6, 7]]
    with pytest.raises(ValueError, match="^sampling_params must be a SamplingParams"):
        runtime.generate([[5, 6, 7]], {"max_tokens": 3})
    assert len(runtime.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 12


def test_final_only_requests_are_reported_once_with_everything(runtime) -> None:
    """Runtime.generate's requests (final_only) produce one output, at the end, equal to a streamed request's
    final output; a streamed request in the same batch still reports every step."""
    engine = runtime.engine
    prompts = [[5, 9, 2, 7], [11, 3]]
    final_id = engine.add_request(prompts[0], GREEDY, final_only=True)
    streamed_id = engine.add_request(prompts[1], GREEDY)
    seen: dict[str, list] = {final_id: [], streamed_id: []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen[final_id]) == 1 and seen[final_id][0].finished
    assert len(seen[streamed_id]) == GREEDY.max_tokens and seen[streamed_id][-1].finished
    final = seen[final_id][0].outputs[0]
    assert final.token_ids == final.delta_token_ids and len(final.token_ids) == GREEDY.max_tokens
    assert final.token_ids == runtime.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
