"""Speculative decoding on the GPU: n-gram proposals under async scheduling (verify steps behind the step in
flight, the pending token copied on the device, FULL verify graphs) give the greedy tokens of decoding without
speculation, on a tiny model whose prompts repeat themselves: in fp32, and in bf16 one request at a time, where
a verify's forward is a decode's bit for bit (the per-token attention path and the small-M GEMM), so even the
logprobs are equal (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_ngram_async_matches_plain_with_graphs(tiny_checkpoint) -> None:
    runtime = Runtime(str(tiny_checkpoint("tiny-llama")[0]), device="cuda", dtype="fp32", level=2,
                      compile_sizes=(), max_num_batched_tokens=128, max_num_seqs=8, kv_cache_bytes=64 << 20,
                      cudagraph_capture_sizes=(1, 2, 4, 8, 16),
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    engine = runtime.engine
    assert engine.async_scheduling
    # each prompt is a random run said twice: n-gram proposals find it, and a random model often loops
    prompts = [p * 2 for p in random_prompts([6, 11, 4, 20, 9], 256, seed=3)]
    params = [SamplingParams(max_tokens=24 + 12 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    spec = engine.speculation
    outs = {}
    for speculate in (False, True):
        engine.speculation = spec if speculate else None
        before = (spec.stats.num_accepted_tokens, engine.stats.verify_behind_steps,
                  engine.graph_replays.get("FULL", 0))
        outs[speculate] = [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]
    assert outs[True] == outs[False]
    # one request at a time: every verify batch is uniform, so FULL verify graphs replay
    for prompt, param, want in zip(prompts, params, outs[False]):
        assert runtime.generate([prompt], param)[0].outputs[0].token_ids == want
    assert spec.stats.num_accepted_tokens > before[0] and engine.stats.verify_behind_steps > before[1]
    assert engine.graph_replays["FULL"] > before[2]
    runtime.shutdown()


def test_bf16_verify_at_batch_one_reproduces_decoding_bit_for_bit(tiny_checkpoint) -> None:
    runtime = Runtime(str(tiny_checkpoint("tiny-llama")[0]), device="cuda", dtype="bf16", level=2,
                      compile_sizes=(), max_num_batched_tokens=128, max_num_seqs=8, kv_cache_bytes=64 << 20,
                      cudagraph_capture_sizes=(1, 2, 4, 8, 16), enable_prefix_caching=False,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    # No prefix cache: the second run of a prompt would prefill only its tail, a chunk of <= 16 tokens that -O2's
    # decode-size passes (gemm_add_rmsnorm<=16) compute in another order than the whole prompt's, so the first
    # token's logprob could part there (seen on the H200, 2026-12-04), before any verify runs.
    engine, spec = runtime.engine, runtime.engine.speculation
    prompts = [p * 2 for p in random_prompts([6, 11, 20], 256, seed=5)]
    param = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt in prompts:  # one request at a time: a k = 4 verify is 5 tokens, within the exact path
        runs = {}
        for speculate in (False, True):
            engine.speculation = spec if speculate else None
            out = runtime.generate([prompt], param)[0].outputs[0]
            runs[speculate] = (out.token_ids, [step.sampled.logprob for step in out.logprobs])
        (spec_ids, spec_lps), (plain_ids, plain_lps) = runs[True], runs[False]
        parted = next((i for i, pair in enumerate(zip(spec_lps, plain_lps)) if pair[0] != pair[1]), None)
        assert spec_ids == plain_ids and parted is None, (
            f"prompt of {len(prompt)}: tokens equal {spec_ids == plain_ids}; first logprob apart at output {parted}: "
            f"{None if parted is None else (spec_lps[parted], plain_lps[parted])}")
    assert spec.stats.num_accepted_tokens > 0
    runtime.shutdown()
