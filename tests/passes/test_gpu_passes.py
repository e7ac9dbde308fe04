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


@pytest.mark.parametrize("passes", [("gate_up_silu_mul",), ("qkv_rope",), ("gemm_add_rmsnorm",),
                                    ("qkv_rope", "gemm_add_rmsnorm", "gate_up_silu_mul")], ids="+".join)
def test_gemm_epilogue_passes_on_a_16_bit_model(tiny_checkpoint, passes: tuple[str, ...]) -> None:
    """bf16 projections run kiln::dense_gemm, so gate_up_silu_mul, qkv_rope and gemm_add_rmsnorm hand each layer's
    SiLU-mul, RoPE and residual add + norm to the GEMM before it (decode in the small-M kernels, prefill through
    torch.mm and the unfused step's kernel): greedy tokens as without, and every pass matched."""
    prompts = random_prompts([1, 7, 30, 3], 256, seed=2)
    options = dict(level=2, device="cuda", dtype="bf16", max_num_batched_tokens=32, max_num_seqs=4,
                   compile_sizes=(1, 4), cudagraph_capture_sizes=(1, 4), num_blocks=64)
    path = str(tiny_checkpoint("tiny-llama")[0])
    outs = {}
    for label, extra in (("off", {"enable_passes": False}), ("on", {"passes": passes})):
        rt = Runtime(path, **options, **extra)
        outs[label] = [o.outputs[0].token_ids for o in rt.generate(prompts, GREEDY)]
        if label == "on":
            manager = pass_manager_of(rt.engine.worker.compiled)
            for name in passes:
                assert manager.total(name) > 0, (name, dict(manager.matches))
        del rt
    assert outs["on"] == outs["off"]
