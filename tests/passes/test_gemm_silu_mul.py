"""gemm_silu_mul: `kiln::dense_gemm(silu(gate) * up, W)` over the halves of one [T, 2I] tensor becomes
`kiln::dense_gemm_silu_mul(gate_up, W)`. kiln::dense_gemm appears only in CUDA graphs (16-bit projections), so
here a 16-bit tiny model is traced with the op let onto the CPU (its torch.mm path), and a function written as
the MLP's tail runs the rewritten graph against the original; the op's kernel and dispatch are checked in
tests/models/test_fp8_kernel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import Runtime
from kiln.compiler.ranges import CompileKey
from kiln.models import dense_gemm
from kiln.passes import PassConfig
from kiln.passes.base import PassEnv
from kiln.passes.gemm_silu_mul import GemmSiluMulPass
from tests.passes.conftest import NUM_LAYERS, PROMPT
from tests.passes.harness import capture, each_piece_with

INTER = 48


def mlp_tail(gate_up: torch.Tensor, w_down: torch.Tensor, w_other: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gate, up = gate_up.split(INTER, dim=-1)
    h = F.silu(gate) * up
    down = torch.ops.kiln.dense_gemm(h.reshape(-1, h.shape[-1]), w_down)
    other = torch.ops.kiln.dense_gemm(gate_up, w_other)  # a GEMM of something else: left alone
    return down, other


def test_the_down_gemm_takes_the_silu_mul_and_numbers_stay() -> None:
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(20, 2 * INTER, generator=g), torch.randn(32, INTER, generator=g) * 0.1,
            torch.randn(8, 2 * INTER, generator=g) * 0.1)  # 20 tokens: the op's torch.mm path, on the CPU
    gm = make_fx(mlp_tail, tracing_mode="fake")(*args)
    assert GemmSiluMulPass(PassConfig(), PassEnv()).apply_post_grad(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    code = gm.code
    assert code.count("kiln.dense_gemm_silu_mul") == 1 and code.count("kiln.dense_gemm.") == 1
    assert "silu" not in code.replace("dense_gemm_silu_mul", "") and "aten.mul" not in code
    for got, want in zip(gm(*args), mlp_tail(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_silu_mul_with_another_user_is_left_alone() -> None:
    def both(gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = gate_up.split(INTER, dim=-1)
        h = F.silu(gate) * up
        return torch.ops.kiln.dense_gemm(h, w_down), h.sum()

    gm = make_fx(both, tracing_mode="fake")(torch.randn(4, 2 * INTER), torch.randn(32, INTER))
    assert GemmSiluMulPass(PassConfig(), PassEnv()).apply_post_grad(gm.graph) == 0


@pytest.mark.parametrize("key", [CompileKey.size(len(PROMPT)), CompileKey.range(1, 32)], ids=["size", "range"])
def test_matches_once_per_layer_in_a_16_bit_models_graph(tiny_checkpoint, monkeypatch, key: CompileKey) -> None:
    monkeypatch.setattr(dense_gemm, "applies", lambda x, bias: bias is None and x.dtype == torch.bfloat16)
    monkeypatch.setattr(dense_gemm, "TRITON_MAX_M", 0)  # the capture's eager run takes torch.mm
    runtime = Runtime(str(tiny_checkpoint("tiny-llama")[0]), level=0, device="cpu", dtype="bf16",
                      max_num_batched_tokens=32, max_num_seqs=4, num_blocks=8)
    total = 0
    for before, after, matched, copies in each_piece_with(capture(runtime, PROMPT).gm, key, "gemm_silu_mul"):
        total += matched * copies
        assert str(after.graph).count("kiln.dense_gemm_silu_mul") == matched
        assert str(after.graph).count("kiln.dense_gemm.") == str(before.graph).count("kiln.dense_gemm.") - matched
    assert total == NUM_LAYERS
