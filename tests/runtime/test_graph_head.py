"""The LM head and greedy argmax inside small FULL graphs (kiln/runtime/graph_head.py), on the CPU through the fake
graph that re-runs what it captured: the tokens are eager decoding's for plain greedy rows (which take the graph's
argmax), seeded sampled rows and biased rows (which sample from the graph's logits), and sizes above the bound
(which compute their logits outside the graph)."""

from __future__ import annotations

import dataclasses

import pytest

from kiln import SamplingParams
from kiln.compiler.cuda_graphs import install_cuda_graphs
from kiln.config import CUDAGraphMode, GraphSupport
from kiln.runtime import graph_head
from tests.compiler.test_cuda_graphs import FakeGraph
from tests.conftest import cpu_runtime, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
BIASED = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={7: 4.0, 9: -100.0}, ignore_eos=True)


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    return cpu_runtime(tiny_checkpoint("tiny-llama"), max_num_batched_tokens=64, max_num_seqs=8)


def _graphed(tiny_checkpoint, monkeypatch, max_tokens: int):
    monkeypatch.setattr(graph_head, "MAX_TOKENS", max_tokens)
    runtime = cpu_runtime(tiny_checkpoint("tiny-llama"), level=1, max_num_batched_tokens=64, max_num_seqs=8)
    worker = runtime.engine.worker
    monkeypatch.setattr(type(worker.backend), "graph_support", GraphSupport.ALWAYS)
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=(1, 2, 4, 8))
    worker.graph_pool = install_cuda_graphs(worker.runner, config, worker.compiled, progress=False,
                                            factory=FakeGraph)
    given: list[bool] = []  # per sampling call: did the graph hand its argmax over
    sample = worker.runner.sampler.sample
    monkeypatch.setattr(worker.runner.sampler, "sample",
                        lambda logits, batch, greedy=None: given.append(greedy is not None) or sample(logits, batch,
                                                                                                      greedy))
    return runtime, given


@pytest.mark.parametrize("max_tokens", [32, 2, 0])
def test_graph_head_gives_eager_tokens(eager, tiny_checkpoint, monkeypatch, max_tokens: int) -> None:
    graphed, given = _graphed(tiny_checkpoint, monkeypatch, max_tokens)
    prompts = random_prompts([3, 7, 1, 4], 256, seed=11)
    for params in (GREEDY, SAMPLED, BIASED, [GREEDY, SAMPLED, BIASED, GREEDY]):
        given.clear()
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == expected
        # 4 rows decode in the 4-token graph, which has the head when the bound allows 4 tokens
        assert any(given) == (max_tokens >= 4)
    assert graphed.engine.graph_replays["FULL"] > 0
    given.clear()
    graphed.generate(prompts[:1], GREEDY)  # one row: the 1-token graph
    assert any(given) == (max_tokens >= 1)
