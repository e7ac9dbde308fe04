"""The block-scaled FP8 GEMM (kiln/models/quant/fp8_block.py): its torch arithmetic against a float64 oracle of
the formula, and the Triton kernel (under the interpreter without a GPU) against that arithmetic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    define_interpreted("kiln.models.quant.fp8_kernel", "kiln.models.quant.fp8_block")

from kiln.models.quant.fp8 import FP8_MAX, quantize_weight  # noqa: E402
from kiln.models.quant.fp8_block import (  # noqa: E402
    GROUP,
    block_scaled_reference,
    fp8_block_gemm_triton,
    quantize_blocks,
)
from kiln.models.quant.fp8_kernel import Fp8GemmConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 activations whose blocks differ in magnitude (a block scale differs from the row's), e4m3 weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k).roll(k // 3)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    return x.to(torch.bfloat16).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)


def test_blocks_take_their_own_scale() -> None:
    x = torch.randn(3, 300, dtype=torch.float64)
    x[1] = 0.0  # an all-zero row keeps the smallest scale, not a division by zero
    q, scale = quantize_blocks(x)
    assert q.shape == (3, 300) and scale.shape == (3, 3)
    for b in range(3):
        block = x[:, b * GROUP:(b + 1) * GROUP]
        amax = block.abs().amax(dim=-1)
        torch.testing.assert_close(scale[0, b].double(), amax[0] / FP8_MAX)
        # each block's largest magnitude maps to the format's largest value
        assert q[0, b * GROUP:(b + 1) * GROUP].float().abs().max() == FP8_MAX
    assert torch.all(q[1].float() == 0) and torch.all(scale[1] > 0)


def test_reference_is_the_formula_in_float64() -> None:
    x, wq, ws = (t.cpu() for t in operands(5, 24, 384 + 40, seed=2))
    q, scale = quantize_blocks(x)
    expected = torch.zeros(5, 24, dtype=torch.float64)
    for kk in range(x.shape[1]):
        expected += q[:, kk:kk + 1].double() * wq[:, kk].double()[None, :] * scale[:, kk // GROUP:kk // GROUP + 1]
    expected *= ws.double()[None, :]
    got = block_scaled_reference(x, wq, ws, torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


# (M, N, K, config): one token and several M tiles, N not a multiple of the tile, K with a short last block,
# split-K even and uneven; None: the shape's own config
CASES = [
    (1, 64, 512, Fp8GemmConfig(64, 128, 1, 4, 3)),
    (3, 80, 300, Fp8GemmConfig(32, 128, 1, 4, 3)),
    (16, 96, 1024, Fp8GemmConfig(32, 128, 4, 4, 3)),
    (19, 48, 640, Fp8GemmConfig(32, 128, 3, 4, 3)),
    (2, 128, 1024, None),
]


@pytest.mark.parametrize("m,n,k,config", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}" for c in CASES])
def test_kernel_matches_the_reference(m: int, n: int, k: int, config: Fp8GemmConfig | None) -> None:
    x, wq, ws = operands(m, n, k, seed=m + k)
    got = fp8_block_gemm_triton(x, wq, ws, torch.float32, config)
    expected = block_scaled_reference(x, wq, ws, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # the same e4m3 operands (one rounding of x / scale); the sums in fp32, on Hopper each MMA group's in reduced
    # precision before the fp32 promotion (tests/models/test_fp8_kernel.py)
    rtol = 2e-3 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_kernel_refuses_a_k_tile_other_than_one_block() -> None:
    x, wq, ws = operands(1, 32, 256, seed=0)
    with pytest.raises(ValueError, match="block_k"):
        fp8_block_gemm_triton(x, wq, ws, torch.float32, Fp8GemmConfig(32, 256, 1, 4, 3))


def test_kernel_quantizes_as_torch_does_ties_and_small_values_included() -> None:
    """The kernel's quantized operand (seen through an identity weight) equals quantize_blocks': every e4m3
    value and every midpoint between two (ties to even), subnormals, and values around each block's amax."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # the non-negative finite values
    mids = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([grid, mids, -mids, torch.linspace(-448, 448, 128 * 6 - 2 * 253)])
    x = torch.stack([row, row * 3.7e-3]).to(DEVICE)  # the second row's scale is not a power of two
    q, scale = quantize_blocks(x)
    eye = torch.eye(row.numel(), dtype=torch.float32).to(torch.float8_e4m3fn).to(DEVICE)
    got = fp8_block_gemm_triton(x, eye, torch.ones(row.numel(), device=DEVICE), torch.float32,
                                Fp8GemmConfig(64, 128, 1, 4, 3))
    expected = q.float() * scale.repeat_interleave(GROUP, dim=1)[:, :row.numel()]
    assert torch.equal(got, expected)
