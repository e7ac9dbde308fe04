"""fp8_weight_only (kiln/passes/fp8_weight_only.py): at one token the per-token quantization and kiln::fp8_gemm of
an activation from outside the graph become kiln::fp8_weight_only_gemm, and gemm_add_rmsnorm folds the add + norm
(and the next projection's quantization) after it; at more tokens nothing changes. kiln::fp8_gemm appears only in
CUDA graphs, so here a block in fp8_linear's CUDA form is traced on the CPU, where the ops run their W8A8 path: the
rewritten graph gives the original's bits. The kernels' weight-only values: tests/models/test_gemv_stream.py; on a
GPU, tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.compiler.ranges import CompileKey
from kiln.models.layers import RMSNorm
from kiln.models.quant.fp8 import quantize_per_token, quantize_weight
from kiln.passes import PassConfig
from kiln.passes.manager import PassManager
from tests.passes.harness import post_grad

HIDDEN, INTER, QKV = 24, 40, 48
PASSES = ("fp8_weight_only<=1", "gemm_add_rmsnorm<=16", "silu_mul_quant<=16", "gate_up_silu_mul<=16")


class Fp8Block(torch.nn.Module):
    """The o projection into the residual stream, the MLP, and the next layer's qkv projection, each FP8 linear as
    fp8_linear runs it on CUDA (per-token quantization, then kiln::fp8_gemm)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.norms = torch.nn.ModuleList(RMSNorm(HIDDEN, 1e-5).to(torch.bfloat16) for _ in range(2))
        for norm in self.norms:
            torch.nn.init.normal_(norm.weight, 1.0, 0.1)
        self.weights = [quantize_weight(torch.randn(n, k, generator=g) * 0.2)
                        for n, k in ((HIDDEN, 32), (2 * INTER, HIDDEN), (HIDDEN, INTER), (QKV, HIDDEN))]

    def linear(self, x: torch.Tensor, i: int) -> torch.Tensor:
        q, scale = quantize_per_token(x)
        return torch.ops.kiln.fp8_gemm(q, *self.weights[i][:1], scale, self.weights[i][1], torch.bfloat16).to(x.dtype)

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = self.norms[0](self.linear(attn, 0), residual)
        gate, up = self.linear(normed, 1).split(INTER, dim=-1)
        normed, summed = self.norms[1](self.linear(F.silu(gate) * up, 2), summed)
        return self.linear(normed, 3), summed


def rewrite(tokens: int, key: CompileKey) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict, list]:
    import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm

    box: dict = {}

    def backend(gm, inputs):
        box["gm"], box["inputs"] = gm, list(inputs)
        return gm.forward

    g = torch.Generator().manual_seed(4)
    args = (torch.randn(tokens, 32, generator=g).bfloat16(), torch.randn(tokens, HIDDEN, generator=g).bfloat16())
    torch._dynamo.reset()
    torch.compile(Fp8Block(), backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    manager = PassManager(PassConfig.from_names(PASSES))
    before, after = post_grad(box["gm"], key, manager)
    return before, after, manager.matches["piece"], box["inputs"]


def test_one_token_runs_weight_only_where_the_activation_comes_from_outside_the_graph() -> None:
    """Only the o projection (its activation a graph input, as the attention's output is after the split) goes
    weight-only; its add + norm then quantizes for gate_up in the same op. The MLP and qkv keep W8A8: their
    quantizations fold into the kernels that compute their activations."""
    before, after, matches, inputs = rewrite(1, CompileKey.size(1))
    assert matches == {"fp8_weight_only": 1, "gemm_add_rmsnorm": 2, "silu_mul_quant": 1, "gate_up_silu_mul": 0}
    code = after.code
    assert "amax" not in code and "rsqrt" not in code and "sigmoid" not in code
    assert code.count("kiln.fp8_weight_only_gemm_add_rms_norm_quant") == 1
    assert code.count("kiln.fp8_gemm_add_rms_norm_quant") == 1 and code.count("kiln.silu_mul_quant") == 1
    assert code.count("kiln.fp8_gemm.") == 2  # gate_up and qkv
    with torch.inference_mode():  # the CPU: every op's W8A8 path, the unfused graph's arithmetic
        for got, want in zip(after(*inputs), before(*inputs)):
            assert torch.equal(got, want)


def test_more_tokens_keep_the_quantized_path() -> None:
    _, after, matches, _ = rewrite(5, CompileKey.range(2, 16))
    assert matches.get("fp8_weight_only", 0) == 0 and matches["silu_mul_quant"] == 1
    assert "fp8_weight_only" not in after.code and after.code.count("kiln.fp8_gemm_add_rms_norm_quant") == 2

