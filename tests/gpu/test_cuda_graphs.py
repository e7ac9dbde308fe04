"""CUDA graphs on the GPU: outputs with graphs equal outputs without, replays instead of re-captures, and no
compile or capture after warm-up (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SIZES = (1, 2, 4, 8, 16, 32, 64)


def generate_staggered(runtime: Runtime, prompts: list[list[int]]) -> list[list[int]]:
    """Requests arrive while others decode, so steps mix prefill chunks and decodes (and pure decodes)."""
    engine = runtime.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    outputs: dict[str, list[int]] = {}
    pending = list(prompts[3:])
    while engine.has_unfinished() or pending:
        if pending and engine.stats.steps % 3 == 2:
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("model, dtype, backend", [
    ("tiny", "fp32", "triton"),
    ("smollm2-135m", "bf16", "triton"),
    ("smollm2-135m", "bf16", "flashinfer"),
])
def test_graphs_match_no_graphs(tiny_checkpoint, model: str, dtype: str, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    path = str(tiny_checkpoint("tiny-llama")[0]) if model == "tiny" else model
    common = dict(device="cuda", dtype=dtype, level=1, attention_backend=backend, max_num_batched_tokens=256,
                  max_num_seqs=32, kv_cache_bytes=256 << 20, cudagraph_capture_sizes=SIZES)
    plain = Runtime(path, cudagraph_mode="NONE", **common)
    graphed = Runtime(path, cudagraph_mode="FULL_AND_PIECEWISE", **common)
    prompts = random_prompts([5, 17, 1, 40, 9, 3, 60, 2], plain.engine.loaded.spec.vocab_size, seed=5)
    expected = generate_staggered(plain, prompts)
    assert generate_staggered(graphed, prompts) == expected
    replays = graphed.engine.graph_replays
    assert replays["FULL"] > 0 and replays["PIECEWISE"] > 0
    pool = graphed.engine.worker.graph_pool
    captures = dict(pool.stats.captures)
    generate_staggered(graphed, prompts[:4])  # same descriptors again: replays only
    assert pool.stats.captures == captures and pool.stats.after_warmup_captures == 0
    assert graphed.compile_stats.compiles_after_warmup == 0 and graphed.compile_stats.traces_after_warmup == 0
    print(f"{model}/{backend}: captures {captures}, replays {graphed.engine.graph_replays}, "
          f"capture {pool.stats.capture_seconds:.1f}s, {pool.stats.memory_bytes / 2**20:.0f} MiB")


@pytest.mark.parametrize("unpack_in_graph", [False, True])
def test_background_swap_recaptures_graphs_on_gpu(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                  unpack_in_graph: bool) -> None:
    """Exact decode sizes compiled after ready and swapped in mid-generation: their graphs (captured with the
    range artifact) are captured again, and tokens equal a runtime that compiled the same sizes up front; with
    the inputs' unpacking launched from the host and at the start of each FULL graph (KILN_UNPACK_IN_GRAPH)."""
    from kiln.runtime import input_upload
    from tests.compiler.test_background_compile import _tokens

    monkeypatch.setattr(input_upload, "IN_GRAPH", unpack_in_graph)
    path = str(tiny_checkpoint("tiny-llama")[0])
    common = dict(device="cuda", dtype="fp32", level=2, attention_backend="triton", max_num_batched_tokens=32,
                  max_num_seqs=4, kv_cache_bytes=64 << 20, cudagraph_capture_sizes=(1, 2, 4, 8))
    upfront = Runtime(path, compile_sizes=(1, 2, 4, 8), **common)
    tuned = Runtime(path, compile_sizes=(), background_compile_sizes=(1, 2, 4, 8), **common)
    assert tuned.engine.worker.compilation.background_compile_sizes == (1, 2, 4, 8)
    pool = tuned.engine.worker.graph_pool
    before = sum(pool.stats.captures.values())
    assert _tokens(tuned, swap_after_steps=3, pending=12) == _tokens(upfront)
    stats = tuned.compile_stats
    assert (stats.background_pending, stats.background_swapped, stats.background_failed) == (0, 12, 0)
    assert sum(pool.stats.captures.values()) > before and pool.stats.after_warmup_captures == 0
    print(f"swap {stats.background_swap_seconds:.2f}s, captures {pool.stats.captures}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9")
def test_pdl_matches_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Triton kernel of a step, kiln's and Inductor's (-O2), launched with programmatic dependent launch
    against all launched plainly (KILN_PDL=0): the same greedy tokens, FULL and PIECEWISE graphs on."""
    import kiln.config as config

    common = dict(device="cuda", dtype="bf16", level=2, max_num_batched_tokens=256, max_num_seqs=32,
                  kv_cache_bytes=256 << 20, cudagraph_capture_sizes=SIZES)
    monkeypatch.setattr(config, "PDL", False)
    plain = Runtime("smollm2-135m", **common)
    assert "triton.enable_pdl" not in dict(plain.engine.worker.compilation.inductor_options)
    prompts = random_prompts([5, 17, 1, 40, 9, 3, 60, 2], plain.engine.loaded.spec.vocab_size, seed=7)
    expected = generate_staggered(plain, prompts)  # all of it before the switch: eager kernels read it per launch
    monkeypatch.setattr(config, "PDL", True)
    pdl = Runtime("smollm2-135m", **common)
    assert dict(pdl.engine.worker.compilation.inductor_options)["triton.enable_pdl"] is True
    assert generate_staggered(pdl, prompts) == expected
    assert pdl.engine.graph_replays["FULL"] > 0
