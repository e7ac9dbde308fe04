"""The fused MoE op on the GPU: its Triton kernels (both shapes, every tuned or ruled config) against the torch
reference on random routing at Qwen3-30B-A3B's layer shape, and a MoE model's greedy tokens with CUDA graphs
equal to those without (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("tokens", [1, 8, 64, 257, 1000])
@pytest.mark.parametrize("block_m", [None, 1, 16, 64])
def test_fused_op_matches_reference_bf16(tokens: int, block_m: int | None) -> None:
    from kiln.models.fused_moe.configs import MoeKernelConfig
    from kiln.models.fused_moe.kernels import fused_moe_triton
    from kiln.models.fused_moe.reference import fused_moe_reference

    e, h, inter, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.03).bfloat16()
    logits = torch.randn(tokens, e, device="cuda", generator=g)
    logits[:, :5] = -1e4  # experts without tokens
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    ids = ids.to(torch.int32)
    config = None if block_m is None else MoeKernelConfig(block_m, 64, 64, 4, 3)
    out = fused_moe_triton(x, w13, w2, weights, ids, config=config).float()
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err


@pytest.mark.parametrize("tokens, block_m", [(1, 1), (8, 1), (257, 16), (1000, 64)])
def test_fused_op_with_fp8_experts_matches_reference(tokens: int, block_m: int) -> None:
    """quantization="fp8": e4m3 expert weights, a scale per (expert, output channel), bf16 activations."""
    from kiln.models.fused_moe.configs import MoeKernelConfig
    from kiln.models.fused_moe.kernels import fused_moe_triton
    from kiln.models.fused_moe.reference import fused_moe_reference
    from kiln.models.quant.fp8 import quantize_weight

    e, h, inter, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13, s13 = quantize_weight(torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.03)
    w2, s2 = quantize_weight(torch.randn(e, h, inter, device="cuda", generator=g) * 0.03)
    weights, ids = torch.topk(torch.randn(tokens, e, device="cuda", generator=g).softmax(-1), k, dim=-1)
    ids = ids.to(torch.int32)
    out = fused_moe_triton(x, w13, w2, weights, ids, s13, s2, config=MoeKernelConfig(block_m, 64, 64, 4, 3)).float()
    ref = fused_moe_reference(x.float(), w13, w2, weights, ids, s13, s2)
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, err


def test_moe_graphs_match_no_graphs(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("tiny-qwen3-moe")[0])
    # a 64-token budget: every prefill chunk and mixed step fits a captured size (PIECEWISE), decodes run FULL
    common = dict(device="cuda", dtype="fp32", level=1, max_num_batched_tokens=64, max_num_seqs=32,
                  kv_cache_bytes=256 << 20, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    plain = Runtime(path, cudagraph_mode="NONE", **common)
    graphed = Runtime(path, cudagraph_mode="FULL_AND_PIECEWISE", **common)
    prompts = random_prompts([5, 17, 1, 40, 9, 3, 60, 2], 256, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == expected
    assert graphed.engine.graph_replays["FULL"] > 0 and graphed.engine.graph_replays["PIECEWISE"] > 0



@pytest.mark.parametrize("tokens", [1, 8, 16, 17])
def test_router_on_the_triton_gemm_agrees_with_cublas(tokens: int) -> None:
    """The router's logits from kiln's small-M kernel (up to 16 tokens; cuBLAS above) agree with cuBLAS's, and every
    expert they pick is among cuBLAS's top k up to the rounding of a logit."""
    from kiln.models.fused_moe import routing

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = (torch.randn(128, 2048, device="cuda", generator=g) * 0.03).bfloat16()
    want = torch.nn.functional.linear(x, gate).float()
    got = routing.router_logits(x, gate).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    kth = torch.topk(want, 8, dim=-1).values[:, -1:]
    picked = torch.topk(got, 8, dim=-1).indices
    assert (want.gather(1, picked) >= kth - 0.05).all()


@pytest.mark.parametrize("tokens", [1, 4])
def test_norm_into_the_router_agrees_with_the_two_ops(tokens: int) -> None:
    """kiln::gemm_add_rms_norm_route (the rmsnorm_gemm pass at a router) at Qwen3-30B-A3B's o projection and router:
    one token on the matrix-vector kernel finishing the row, four on the two ops (the same values). At one token h
    exactly the unfused op's, the normalised row (the experts read it) and the routing weights within a rounding,
    each picked expert among the unfused top k up to the rounding of a logit."""
    import kiln.passes.ops  # noqa: F401 - registers the fused ops
    from kiln.models.fused_moe import routing

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    o = (torch.randn(2048, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    residual = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(2048, device="cuda", generator=g)).bfloat16()
    gate = (torch.randn(128, 2048, device="cuda", generator=g) * 0.03).bfloat16()
    weights, ids, h, normed = torch.ops.kiln.gemm_add_rms_norm_route(x, o, residual, norm_weight, 1e-6, gate, 8, True)
    want_normed, want_h = torch.ops.kiln.gemm_add_rms_norm(x, o, residual, norm_weight, 1e-6)
    want_weights, want_ids = routing.moe_route(want_normed, gate, 8, True)
    assert torch.equal(h, want_h)
    if tokens > 1:  # the two ops themselves
        assert torch.equal(normed, want_normed) and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        return
    torch.testing.assert_close(normed.float(), want_normed.float(), rtol=2 ** -7, atol=1e-3)
    logits = routing.router_logits(want_normed, gate).float()
    kth = torch.topk(logits, 8, dim=-1).values[:, -1:]
    assert (logits.gather(1, ids.long()) >= kth - 0.05).all()
    if torch.equal(ids.sort(-1).values, want_ids.sort(-1).values):  # the same experts: the same weights, rounded
        torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), want_weights.gather(1, want_ids.argsort(-1)),
                                   rtol=2e-2, atol=2e-3)
