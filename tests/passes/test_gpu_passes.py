"""On a GPU: every pass on vs off gives the same greedy tokens, with the fused ops on their Triton kernels.

fp32, so the comparison is exact in practice; rope_kv applies with both backends: the torch backend attends from
the cache alone, the triton backend's decode kernel rotates (and norms) q and the new key itself.
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


@pytest.mark.parametrize("passes", [("gate_up_silu_mul",), ("qkv_rope",), ("qkv_rope", "gate_up_silu_mul")],
                         ids="+".join)
def test_gemm_epilogue_passes_on_a_16_bit_model(tiny_checkpoint, passes: tuple[str, ...]) -> None:
    """bf16 projections run kiln::dense_gemm, so gate_up_silu_mul and qkv_rope hand each layer's SiLU-mul and RoPE
    to the GEMM before it (decode in the small-M kernels' epilogues, prefill through torch.mm and the unfused
    step's kernel), rounding where the unfused graph rounds: greedy tokens as without, and every pass matched."""
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


@pytest.mark.parametrize(("quantization", "passes"), [
    (None, ("gemm_add_rmsnorm",)), ("fp8", ("gemm_add_rmsnorm",)),
    (None, ("gemm_add_rmsnorm", "gate_up_silu_mul", "rmsnorm_gemm"))])
def test_gemm_add_rmsnorm_on_a_gpu(tiny_checkpoint, quantization: str | None, passes: tuple[str, ...]) -> None:
    """gemm_add_rmsnorm hands the residual add and the next norm after o and down (FP8: and the next projection's
    quantization) to the GEMM's second kernel; rmsnorm_gemm then hands that kernel's work to the next projection's
    GEMM. The sum of squares runs in another order than Inductor's reduction (and rmsnorm_gemm rounds the norm
    elsewhere), so a normalised row may differ from the unfused graph's by a bf16 rounding and greedy tokens may part
    at a near-tie: the logits of prompts of up to 16 tokens (the small-M kernels) and of 30 (the unfused path) stay
    within bf16 noise of the unfused graph's, and the passes matched."""
    from tests.conftest import prompt_logits

    options = dict(level=2, device="cuda", dtype="bf16", max_num_batched_tokens=32, max_num_seqs=4,
                   compile_sizes=(1, 4), cudagraph_capture_sizes=(1, 4), num_blocks=64,
                   **({"quantization": quantization} if quantization else {}))
    path = str(tiny_checkpoint("tiny-llama")[0])
    prompts = random_prompts([1, 5, 16, 30], 256, seed=3)
    logits = {}
    for label, extra in (("off", {"enable_passes": False}), ("on", {"passes": passes})):
        rt = Runtime(path, **options, **extra)
        logits[label] = [prompt_logits(rt, p) for p in prompts]
        if label == "on":
            manager = pass_manager_of(rt.engine.worker.compiled)
            assert all(manager.total(name) > 0 for name in passes), dict(manager.matches)
        del rt
    for on, off in zip(logits["on"], logits["off"]):
        scale = off.abs().max().item()
        assert (on - off).abs().max().item() <= 0.02 * scale, ((on - off).abs().max().item(), scale)
