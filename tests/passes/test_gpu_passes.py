"""On a GPU: every pass on vs off gives the same greedy tokens, with the fused ops on their Triton kernels.

fp32, so the comparison is exact in practice; the torch backend attends from the cache alone (rope_kv
applies), the triton backend does not (rope_kv stays off, the other passes apply).
"""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.passes import ALL_PASSES, pass_manager_of
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_passes_on_vs_off_on_gpu(tiny_checkpoint, preset: str, backend: str) -> None:
    prompts = random_prompts([1, 7, 30, 3], 256, seed=2)
    options = dict(level=2, device="cuda", dtype="fp32", attention_backend=backend, max_num_batched_tokens=32,
                   max_num_seqs=4, compile_sizes=(1, 4), cudagraph_capture_sizes=(1, 4), num_blocks=64)
    path = str(tiny_checkpoint(preset)[0])
    outs = {}
    for label, extra in (("off", {"enable_passes": False}), ("on", {"passes": ALL_PASSES})):
        rt = Runtime(path, **options, **extra)
        outs[label] = [o.outputs[0].token_ids for o in rt.generate(prompts, GREEDY)]
        if label == "on":
            names = {p.name for p in pass_manager_of(rt.engine.worker.compiled).passes}
            assert names == set(ALL_PASSES)
        del rt
    assert outs["on"] == outs["off"]


def test_gemm_silu_mul_on_a_16_bit_model(tiny_checkpoint, tmp_path) -> None:
    """bf16 projections run kiln::dense_gemm, so gemm_silu_mul takes each layer's SiLU-mul into the down GEMM
    (decode in the small-M kernel's loads, prefill through silu_and_mul and torch.mm): greedy tokens as without.
    The pass's graph dumps (debug_dump_path) name what it saw where it matched nothing."""
    from kiln.passes.manager import GRAPH_SCOPE

    prompts = random_prompts([1, 7, 30, 3], 256, seed=2)
    options = dict(level=2, device="cuda", dtype="bf16", max_num_batched_tokens=32, max_num_seqs=4,
                   compile_sizes=(1, 4), cudagraph_capture_sizes=(1, 4), num_blocks=64)
    path = str(tiny_checkpoint("tiny-llama")[0])
    outs = {}
    on = {"passes": ("gemm_silu_mul",), "debug_dump_path": str(tmp_path)}
    for label, extra in (("off", {"enable_passes": False}), ("on", on)):
        rt = Runtime(path, **options, **extra)
        outs[label] = [o.outputs[0].token_ids for o in rt.generate(prompts, GREEDY)]
        if label == "on":
            matches = pass_manager_of(rt.engine.worker.compiled).matches
            seen = "\n".join(line for dump in sorted(tmp_path.rglob("*gemm_silu_mul.before.txt"))[:2]
                             for line in dump.read_text().splitlines()
                             if any(w in line for w in ("dense_gemm", "silu", "mul", "split", "view", "sigmoid")))
            assert sum(m.get("gemm_silu_mul", 0) for scope, m in matches.items() if scope != GRAPH_SCOPE) > 0, seen
        del rt
    assert outs["on"] == outs["off"]
