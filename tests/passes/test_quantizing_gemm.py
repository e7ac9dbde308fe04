"""quantizing_gemm (post-grad, as Inductor normalises the graph): an FP8 projection whose e4m3 operand and scale come
only from a per-token quantization (torch's, or kiln::silu_mul_quant's of a gate_up) takes the 16-bit activation and
quantizes it itself: kiln::fp8_gemm becomes kiln::fp8_quantizing_gemm, kiln::fp8_gemm_add_rms_norm_quant (behind
gemm_add_rmsnorm) kiln::fp8_quantizing_gemm_add_rms_norm_quant. On the CPU the fused ops quantize first and run the
ops they replace, so the rewritten graph's values equal the original's bit for bit; their kernel is checked in
tests/models/test_fp8_quantizing_gemm.py, on a GPU too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.ranges import CompileKey
from kiln.passes import PassConfig
from kiln.passes.manager import PassManager
from tests.passes.harness import post_grad

HIDDEN, INTER = 24, 40


class Fp8Block(torch.nn.Module):
    """An o projection (quantized attention output) joining the residual and the next norm + quantization, and a
    down projection on silu(gate) * up, both in fp8_linear's CUDA form; `shared`: the o operand's e4m3 values also
    feed something else."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        from kiln.models.layers import RMSNorm
        from kiln.models.quant.fp8 import quantize_weight

        g = torch.Generator().manual_seed(4)
        self.norm = RMSNorm(HIDDEN, 1e-5).to(torch.bfloat16)
        torch.nn.init.normal_(self.norm.weight, 1.0, 0.1)
        self.wo, self.so = quantize_weight(torch.randn(HIDDEN, 32, generator=g) * 0.2)
        self.wd, self.sd = quantize_weight(torch.randn(HIDDEN, INTER, generator=g) * 0.2)
        self.shared = shared

    def forward(self, attn: torch.Tensor, residual: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from kiln.models.quant.fp8 import quantize_per_token

        q, scale = quantize_per_token(attn)
        y = torch.ops.kiln.fp8_gemm(q, self.wo, scale, self.so, torch.bfloat16)
        normed, summed = self.norm(y, residual)
        gate, up = gate_up.chunk(2, dim=-1)
        qd, sd = quantize_per_token(F.silu(gate) * up)
        down = torch.ops.kiln.fp8_gemm(qd, self.wd, sd, self.sd, torch.bfloat16)
        return (*quantize_per_token(normed), summed, down, *((q.float().sum(),) if self.shared else ()))


def rewritten(shared: bool) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list, PassManager]:
    import kiln.models.quant.fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm

    box: dict = {}

    def backend(gm, inputs):
        box["gm"], box["inputs"] = gm, list(inputs)
        return gm.forward

    g = torch.Generator().manual_seed(5)
    inputs = (torch.randn(7, 32, generator=g).bfloat16(), torch.randn(7, HIDDEN, generator=g).bfloat16(),
              torch.randn(7, 2 * INTER, generator=g).bfloat16())
    torch._dynamo.reset()
    torch.compile(Fp8Block(shared), backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    manager = PassManager(PassConfig.from_names(["gemm_add_rmsnorm", "silu_mul_quant", "quantizing_gemm"]))
    before, after = post_grad(box["gm"], CompileKey.size(7), manager)
    return before, after, box["inputs"], manager


def test_both_projections_quantize_their_activation_and_numbers_stay() -> None:
    before, after, inputs, manager = rewritten(shared=False)
    assert manager.matches["piece"].get("quantizing_gemm", 0) == 2
    code = after.code
    assert code.count("kiln.fp8_quantizing_gemm_add_rms_norm_quant") == 1
    assert code.count("kiln.fp8_quantizing_gemm.") == 1
    assert "kiln.fp8_gemm." not in code and "kiln.silu_mul_quant" not in code
    assert code.count("amax") == 0  # the third quantization, of the normed row, is the row kernel's
    with torch.inference_mode():
        for got, want in zip(after(*inputs), before(*inputs)):
            assert torch.equal(got.float(), want.float())


def test_an_operand_with_another_user_keeps_its_quantization() -> None:
    _, after, _, manager = rewritten(shared=True)
    assert manager.matches["piece"].get("quantizing_gemm", 0) == 1  # the down projection's alone
    assert after.code.count("kiln.fp8_gemm_add_rms_norm_quant") == 1


@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_ops_fake_gives_the_replaced_ops_shapes(silu_mul: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import kiln.passes.ops  # noqa: F401 - registers the ops

    with FakeTensorMode():
        a = torch.empty(3, 2 * INTER if silu_mul else INTER, dtype=torch.bfloat16)
        w, ws = torch.empty(HIDDEN, INTER, dtype=torch.float8_e4m3fn), torch.empty(HIDDEN)
        out = torch.ops.kiln.fp8_quantizing_gemm(a, w, ws, torch.bfloat16, silu_mul)
        q, scale, summed = torch.ops.kiln.fp8_quantizing_gemm_add_rms_norm_quant(
            a, w, ws, torch.empty(3, HIDDEN, dtype=torch.bfloat16), torch.empty(HIDDEN, dtype=torch.bfloat16), 1e-5,
            silu_mul)
    assert out.shape == (3, HIDDEN) and out.dtype == torch.bfloat16
    assert (q.shape, q.dtype, scale.shape, summed.shape) == ((3, HIDDEN), torch.float8_e4m3fn, (3, 1), (3, HIDDEN))
