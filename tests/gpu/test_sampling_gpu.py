"""The sampler's per-request inputs on the GPU, inside CUDA graphs and overlapped steps: prompt logprobs, logit bias
and allowed token ids against transformers on the same fp32 weights (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def greedy_with_mask(hf: torch.nn.Module, prompt: list[int], steps: int, bias: torch.Tensor) -> list[int]:
    """transformers' greedy continuation with `bias` added to every step's logits (-inf bans a token)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int((hf(torch.tensor([ids], device="cuda")).logits[0, -1].float() + bias).argmax()))
    return ids[len(prompt):]


def test_prompt_logprobs_bias_and_allowed_ids_with_graphs_and_async(tiny_checkpoint) -> None:
    """Chunked prefills with prompt-logprob rows beside decodes, graphed (FULL and PIECEWISE) and overlapped: each
    prompt position's logprob, rank and top 2 equal transformers' teacher-forced log-softmax; a biased and an
    allowed-ids request equal transformers' greedy under the same mask; a plain request keeps its tokens."""
    path, hf_cpu = tiny_checkpoint("tiny-llama")
    hf = copy.deepcopy(hf_cpu).to("cuda")
    runtime = Runtime(str(path), device="cuda", dtype="fp32", level=2, compile_sizes=(), attention_backend="triton",
                      max_num_batched_tokens=16, max_num_seqs=8, kv_cache_bytes=64 << 20, async_scheduling=True,
                      cudagraph_capture_sizes=(1, 2, 4, 8, 16))
    vocab = runtime.engine.loaded.spec.vocab_size
    scored, biased, allowed, plain = random_prompts([37, 11, 6, 23], vocab, seed=21)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = runtime.generate([plain], greedy)[0].outputs[0].token_ids
    first = runtime.generate([biased], greedy)[0].outputs[0].token_ids
    bias = {first[0]: -100.0, 7: 3.0}
    allowed_ids = [3, 50, 99, 180, first[0]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=bias),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed_ids),
              greedy]
    outs = runtime.generate([scored, biased, allowed, plain], params)
    assert runtime.engine.graph_replays["FULL"] > 0 and runtime.engine.graph_replays["PIECEWISE"] > 0

    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([scored], device="cuda")).logits[0].float(), dim=-1)
    got = outs[0].prompt_logprobs
    assert len(got) == len(scored) and got[0] is None
    for pos, entry in enumerate(got[1:], start=1):
        row, token = ref[pos - 1], scored[pos]
        assert entry.sampled.token_id == token
        assert entry.sampled.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.sampled.rank == int((row > row[token]).sum()) + 1
        assert [t.token_id for t in entry.top] == torch.topk(row, 2).indices.tolist()

    add = torch.zeros(vocab, device="cuda")
    for token, value in bias.items():
        add[token] = value
    assert outs[1].outputs[0].token_ids == greedy_with_mask(hf, biased, 10, add) != first
    only = torch.full((vocab,), float("-inf"), device="cuda")
    only[allowed_ids] = 0.0
    assert outs[2].outputs[0].token_ids == greedy_with_mask(hf, allowed, 10, only)
    assert outs[3].outputs[0].token_ids == alone
