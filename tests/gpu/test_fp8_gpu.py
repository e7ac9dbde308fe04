"""FP8 linear weights on the GPU: torch._scaled_mm's row-wise bf16 path against a dequantized reference, and
the compiled, CUDA-graphed FP8 model against the eager FP8 model (skipped without a GPU with FP8 GEMMs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.models.quant.fp8 import FP8_DTYPE, dequantize, fp8_linear, quantize_per_token, quantize_weight
from tests.conftest import random_prompts

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not FP8_GPU, reason="needs an sm89+ GPU")]


@pytest.mark.parametrize("m", [1, 8, 64, 100])
def test_scaled_mm_rowwise_bf16_matches_reference(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(6144, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    wq, ws = quantize_weight(w)
    got = fp8_linear(x, wq, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 6144)
    x_scale = x.float().abs().amax(-1, keepdim=True) / 448.0
    expected = ((x.float() / x_scale).to(FP8_DTYPE).float() * x_scale) @ dequantize(wq, ws, torch.float32).t()
    assert ((got.float() - expected).norm() / expected.norm()).item() < 1e-2  # bf16 output rounding


def test_compiled_graphed_fp8_matches_eager_fp8() -> None:
    prompts = random_prompts([1, 5, 17, 40, 9, 26], 49152, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="bf16", load_format="dummy", quantization="fp8",
                  gpu_memory_utilization=0.3, attention_backend="triton")
    eager = Runtime("smollm2-135m", level=0, **common)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    del eager
    graphed = Runtime("smollm2-135m", level=2, cudagraph_capture_sizes=(1, 2, 4, 8), **common)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    # bf16 kernels differ between eager and Inductor, so allow a late divergence; the first tokens must agree
    assert sum(a[:4] == b[:4] for a, b in zip(got, expected)) >= len(prompts) - 1, (got, expected)


# --- kiln's Triton FP8 GEMM (kiln::fp8_gemm's small-M path) ------------------------------------------------

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def count_triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The M of every call kiln::fp8_gemm makes to the Triton kernel from now on (the op looks it up per call)."""
    from kiln.models.quant import fp8_kernel

    calls: list[int] = []
    original = fp8_kernel.fp8_gemm_triton

    def counted(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(fp8_kernel, "fp8_gemm_triton", counted)
    return calls


@pytest.mark.parametrize("proj", sorted(LLAMA3_8B))
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
def test_triton_fp8_gemm_matches_scaled_mm_at_llama_shapes(proj: str, m: int) -> None:
    from kiln.models.quant.fp8_gemm import scaled_mm
    from kiln.models.quant.fp8_kernel import fp8_gemm_triton

    n, k = LLAMA3_8B[proj]
    g = torch.Generator(device="cuda").manual_seed(m)
    wq, ws = quantize_weight((torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16())
    xq, xs = quantize_per_token(torch.randn(m, k, device="cuda", generator=g).bfloat16())
    got = fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16)  # the heuristic's config
    expected = scaled_mm(xq, wq, xs, ws, torch.bfloat16)
    # the same fp32 products summed in another order, then one bf16 rounding each: at most ~1 bf16 ulp apart
    torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-7, atol=1e-3 * expected.abs().max().item())
    reference = (xq.double() @ wq.double().t()) * xs.double() * ws.double()
    assert ((got.double() - reference).norm() / reference.norm()).item() < 2e-3


@pytest.mark.parametrize("m", [3, 64])
def test_every_swept_tile_config_is_correct(m: int) -> None:
    """The tiles bench_gemm's sweep may put into fp8_kernel.TUNED, each with and without split-K, at each fp32
    promotion interval it sweeps but Triton's default (0: the whole K loop, up to 3 bf16 ulps off)."""
    from benchmarks.bench_gemm import candidate_tiles
    from kiln.models.quant.fp8_gemm import scaled_mm
    from kiln.models.quant.fp8_kernel import Fp8GemmConfig, fp8_gemm_triton

    g = torch.Generator(device="cuda").manual_seed(m)
    wq, ws = quantize_weight((torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16())
    xq, xs = quantize_per_token(torch.randn(m, 4096, device="cuda", generator=g).bfloat16())
    expected = scaled_mm(xq, wq, xs, ws, torch.bfloat16).float()
    for tile in candidate_tiles():
        for split, promote in itertools.product((1, 4), (32, 64, 128)):
            config = Fp8GemmConfig(tile.block_n, tile.block_k, split, tile.num_warps, tile.num_stages, promote)
            got = fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16, config).float()
            torch.testing.assert_close(got, expected, rtol=2.0**-7, atol=1e-3 * expected.abs().max().item(),
                                       msg=lambda text, c=config: f"{c}: {text}")


def test_fp8_linear_dispatches_on_m(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.models.quant import fp8_gemm

    calls = count_triton_calls(monkeypatch)
    monkeypatch.setattr(fp8_gemm, "TRITON_MAX_M", 16)
    w = (torch.randn(512, 256, device="cuda") * 0.02).bfloat16()
    wq, ws = quantize_weight(w)
    for m in (1, 16, 17, 100):
        fp8_linear(torch.randn(m, 256, device="cuda").bfloat16(), wq, ws)
    assert calls == [1, 16]


def test_greedy_tokens_match_between_triton_and_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled, CUDA-graphed FP8 model with the Triton small-M GEMM against the same model on _scaled_mm only,
    teacher-forced: at each of the reference's first 8 greedy positions both runtimes see the same tokens, and their
    choices must agree wherever the reference's top two logprobs are more than NEAR_TIE apart. Random weights give
    runs of near-tied logits, where the two GEMMs' different summation orders may flip a token without either being
    wrong (free-running, one flip changes every later token: 4 of 6 prompts agreed on 8 tokens, H200, 2026-11-30);
    a wrong scale, tile or reduction moves logits by far more than NEAR_TIE and fails here."""
    from kiln.models.quant import fp8_gemm

    near_tie = 0.05  # nats: ~10 bf16 ulps of this model's logits (|logit| ~ 1)
    calls = count_triton_calls(monkeypatch)
    prompts = random_prompts([1, 5, 17, 40, 9, 26], 49152, seed=7)
    common = dict(device="cuda", dtype="bf16", load_format="dummy", quantization="fp8", level=2,
                  cudagraph_capture_sizes=(1, 2, 4, 8), gpu_memory_utilization=0.3, attention_backend="triton")
    step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
    monkeypatch.setattr(fp8_gemm, "TRITON_MAX_M", 0)
    cublas = Runtime("smollm2-135m", **common)
    greedy = [o.outputs[0].token_ids for o in cublas.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    contexts = [p + g[:j] for p, g in zip(prompts, greedy) for j in range(8)]
    expected = [o.outputs[0].logprobs[0] for o in cublas.generate(contexts, step)]
    del cublas
    assert not calls
    monkeypatch.setattr(fp8_gemm, "TRITON_MAX_M", 64)
    triton_rt = Runtime("smollm2-135m", **common)
    got = [o.outputs[0].logprobs[0] for o in triton_rt.generate(contexts, step)]
    assert calls and max(calls) <= 64  # the kernel ran (decode steps, short prefills) and only for small M
    decisive = [(e, g) for e, g in zip(expected, got) if e.top[0].logprob - e.top[1].logprob > near_tie]
    assert len(decisive) >= len(contexts) // 2, "too few decisive positions for the check to mean anything"
    assert all(g.sampled.token_id == e.sampled.token_id for e, g in decisive), \
        [(e.sampled.token_id, g.sampled.token_id) for e, g in decisive if g.sampled.token_id != e.sampled.token_id]
    # the chosen token's logprob itself: the same up to the FP8 GEMMs' rounding
    assert max(abs(g.sampled.logprob - e.sampled.logprob) for e, g in decisive) < near_tie
