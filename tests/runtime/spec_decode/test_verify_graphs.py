"""FULL CUDA graphs for uniform verify batches (every request k + 1 tokens), on the CPU through a fake graph that
re-runs what it captured (tests/compiler/test_cuda_graphs.py): the dispatcher pads the request count to a
capture size, padded requests attend to the null block, and the tokens are those of eager decoding without
speculation."""

from __future__ import annotations

import dataclasses

from kiln import SamplingParams
from kiln.compiler.cuda_graphs import RunMode, install_cuda_graphs
from kiln.config import CUDAGraphMode, GraphSupport
from tests.compiler.test_cuda_graphs import FakeGraph
from tests.conftest import cpu_runtime

K = 3
SIZES = (1, 2, 4, 8, 16)


def test_uniform_verify_batches_replay_full_graphs(tiny_checkpoint, monkeypatch) -> None:
    kwargs = dict(max_num_batched_tokens=64, max_num_seqs=8)
    eager = cpu_runtime(tiny_checkpoint("tiny-llama"), **kwargs)
    graphed = cpu_runtime(tiny_checkpoint("tiny-llama"), level=1, **kwargs,
                          speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1})
    worker, runner = graphed.engine.worker, graphed.engine.runner
    monkeypatch.setattr(type(worker.backend), "graph_support", GraphSupport.ALWAYS)
    config = dataclasses.replace(worker.compilation, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                 cudagraph_capture_sizes=SIZES)
    pool = install_cuda_graphs(runner, config, worker.compiled, progress=False, factory=FakeGraph,
                               verify_len=worker._verify_len())
    worker.graph_pool = pool
    verify_keys = sorted(d.num_reqs for d in runner.full_graph.entries if d.verify_len == K + 1)
    assert verify_keys == [1, 2, 4]  # R requests of 4 tokens within the largest capture size (16 tokens)

    seen = []
    dispatch = runner.graphs.dispatch
    monkeypatch.setattr(runner.graphs, "dispatch", lambda desc: seen.append((desc, dispatch(desc))) or seen[-1][1])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # three requests alike: the same proposals, so uniform verify batches of 3 requests, padded to 4; then a
    # mixed batch (proposals of different lengths: PIECEWISE)
    for prompts in ([[9, 10, 11] * 6] * 3, [[5, 6, 7, 8] * 5, [12, 13] * 4]):
        expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        assert got == expected
    assert graphed.stats()["spec_decode_num_draft_tokens"] > 0
    full_verify = [d for d, mode in seen if mode is RunMode.FULL and d.verify_len]
    assert {d.num_reqs for d in full_verify} == {4}
    assert all(d.num_tokens == d.num_reqs * (K + 1) for d in full_verify)
    assert pool.stats.after_warmup_captures == 0
