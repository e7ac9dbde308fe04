"""Overlapped scheduling on the GPU: the same greedy tokens as synchronous steps, with CUDA graphs, on a tiny
model for each GPU attention backend (a tiny fp32 model, exact, on Triton; the embedded SmolLM2-135M in bf16 on
FlashInfer, which has neither fp32 kernels nor the tiny model's head size 16), while steps really overlap (skipped
without a GPU). Prefix caching is off: the second run's prompts would hit the first's blocks and be batched otherwise,
and in bf16 another batch shape may flip a near-tie without anything wrong (seen on the H200: one request of ten
differed from its 16th token on)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_async_matches_sync_with_graphs(tiny_checkpoint, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    tiny = backend == "triton"
    model, dtype = (str(tiny_checkpoint("tiny-llama")[0]), "fp32") if tiny else ("smollm2-135m", "bf16")
    runtime = Runtime(model, device="cuda", dtype=dtype, level=2,
                      compile_sizes=(), attention_backend=backend, max_num_batched_tokens=128, max_num_seqs=16,
                      kv_cache_bytes=64 << 20, cudagraph_capture_sizes=(1, 2, 4, 8, 16),
                      enable_prefix_caching=False)
    prompts = random_prompts([5, 17, 1, 40, 9, 3, 60, 2, 33, 12], runtime.engine.loaded.spec.vocab_size, seed=9)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    runs = {}
    for overlap in (False, True):
        runtime.engine.async_scheduling = overlap
        before = runtime.engine.stats_snapshot()["overlapped_steps"]
        runs[overlap] = [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]
        overlapped = runtime.engine.stats_snapshot()["overlapped_steps"] - before
        assert (overlapped > 0) == overlap
    assert runs[True] == runs[False]
    assert runtime.engine.graph_replays["FULL"] > 0


def test_unpacking_inside_full_graphs_gives_the_same_tokens(tiny_checkpoint, monkeypatch) -> None:
    """KILN_UNPACK_IN_GRAPH: FULL graphs begin with the inputs' unpacking, which reads the counts and the step in
    flight's samples from the staged header; replays then launch no unpacking from the host. Greedy (the graph's
    argmax) and seeded sampled rows (the sampler's tokens) give the tokens of a runtime that unpacks eagerly, with
    steps overlapped and not."""
    from kiln.runtime import input_upload, model_runner

    def build() -> Runtime:
        return Runtime(str(tiny_checkpoint("tiny-llama")[0]), device="cuda", dtype="fp32", level=2, compile_sizes=(),
                       max_num_batched_tokens=128, max_num_seqs=16, kv_cache_bytes=64 << 20,
                       cudagraph_capture_sizes=(1, 2, 4, 8, 16), enable_prefix_caching=False)

    prompts = random_prompts([5, 17, 1, 40, 9, 3], 256, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    eager_unpacks: list[int] = []
    unpack = model_runner.unpack
    monkeypatch.setattr(model_runner, "unpack", lambda *a: eager_unpacks.append(1) or unpack(*a))
    runs = {}
    for in_graph in (False, True):
        monkeypatch.setattr(input_upload, "IN_GRAPH", in_graph)
        runtime = build()
        for overlap in (False, True):
            runtime.engine.async_scheduling = overlap
            replays = runtime.engine.graph_replays.get("FULL", 0)
            eager_unpacks.clear()
            runs[in_graph, overlap] = [o.outputs[0].token_ids for o in runtime.generate(prompts, params)]
            steps = runtime.engine.graph_replays["FULL"] - replays
            assert steps > 0 and (len(eager_unpacks) < steps) == in_graph
        runtime.shutdown()
    assert runs[True, False] == runs[False, False] and runs[True, True] == runs[False, True]
