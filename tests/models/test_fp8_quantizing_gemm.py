"""The FP8 GEMM that quantizes its own activation (kiln/models/quant/fp8_quantizing_gemm.py) against the unfused
path it stands for: the activation quantized per token (kiln/models/quant/fp8.py; for SiLU-mul, kiln::silu_mul_quant's
kernel), then kiln's FP8 GEMM kernel on the same tile config. The e4m3 operands, the K split and so the sums are the
same, so the outputs must be equal bit for bit. Without a GPU the kernels run under Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    define_interpreted("kiln.models.quant.fp8_kernel", "kiln.models.quant.fp8_quantizing_gemm", "kiln.passes.kernels",
                       "kiln.models.gemm_epilogues")

from kiln.models.gemm_epilogues import (  # noqa: E402
    fp8_gemm_add_rms_norm_quant_triton,
    fp8_quantizing_gemm_add_rms_norm_quant_triton,
)
from kiln.models.quant.fp8 import quantize_per_token, quantize_weight  # noqa: E402
from kiln.models.quant.fp8_kernel import Fp8GemmConfig, fp8_gemm_triton, gemm_partials  # noqa: E402
from kiln.models.quant.fp8_quantizing_gemm import quantizing_gemm  # noqa: E402
from kiln.passes.kernels import silu_mul_quant_triton  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _operands(m: int, n: int, k: int, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without SiLU-mul, on the CPU, e4m3 values / 8 with 56 in every row: each row's scale is 1/8 and every quotient
    an e4m3 value, since the interpreter's fp32 -> e4m3 cast rounds otherwise than torch's (the GPU's does not)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    a = torch.randn(m, 2 * k if silu_mul else k, generator=gen) * 3
    if silu_mul or DEVICE == "cuda":
        a[0, 5] = 40.0  # an outlier: the row's scale comes from it, not from the tile that holds it
    else:
        a = (a * 16).clamp(-440, 440).to(torch.float8_e4m3fn).float() / 8
        a[:, 5] = 56.0
    w, ws = quantize_weight(torch.randn(n, k, generator=gen) * 0.05)
    return a.to(torch.bfloat16).to(DEVICE), w.to(DEVICE), ws.to(DEVICE)


def _quantized(a: torch.Tensor, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As the served graph quantizes: kiln::silu_mul_quant's kernel, or Inductor's kernel for quantize_per_token
    (on a GPU Triton's fp32 division is the one both kernels use)."""
    if silu_mul:
        return silu_mul_quant_triton(a)
    return (torch.compile(quantize_per_token, dynamic=False) if DEVICE == "cuda" else quantize_per_token)(a)


# split 1 (scales in the GEMM's epilogue) and split 3 (partials, the last split past K, then the reduce); K of 200
# leaves a partial BLOCK_K tile, N of 48 a partial BLOCK_N tile, M of 18 two BLOCK_M tiles of 16
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("m,n,k,split", [(1, 64, 256, 1), (1, 48, 200, 3), (18, 64, 192, 2)])
def test_equals_quantizing_first(m: int, n: int, k: int, split: int, silu_mul: bool) -> None:
    a, w, ws = _operands(m, n, k, silu_mul)
    config = Fp8GemmConfig(block_n=32, block_k=64, split_k=split, num_warps=4, num_stages=2)
    q, scale = _quantized(a, silu_mul)
    expected = fp8_gemm_triton(q, w, scale, ws, torch.bfloat16, config)
    out, none = quantizing_gemm(a, w, ws, silu_mul, config=config)
    assert none is None
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_partials_and_scales_for_a_kernel_after_it(silu_mul: bool) -> None:
    a, w, ws = _operands(3, 64, 256, silu_mul)
    config = Fp8GemmConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2)
    q, scale = _quantized(a, silu_mul)
    partials, scales = quantizing_gemm(a, w, ws, silu_mul, partials=True, config=config)
    torch.testing.assert_close(scales, scale.reshape(-1), rtol=0, atol=0)
    torch.testing.assert_close(partials, gemm_partials(q, w, (scale.reshape(-1), ws), config), rtol=0, atol=0)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_add_norm_quant_epilogue_on_its_sums(silu_mul: bool) -> None:
    """kiln::fp8_quantizing_gemm_add_rms_norm_quant's kernels: the row kernel on this GEMM's partials and scales
    gives what it gives on the separately quantized activation's."""
    a, w, ws = _operands(2, 64, 256, silu_mul)
    gen = torch.Generator().manual_seed(9)
    residual = torch.randn(2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16).to(DEVICE)
    config = Fp8GemmConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2)
    q, scale = _quantized(a, silu_mul)
    expected = fp8_gemm_add_rms_norm_quant_triton(q, w, scale, ws, residual, norm_weight, 1e-5, config)
    got = fp8_quantizing_gemm_add_rms_norm_quant_triton(a, w, ws, residual, norm_weight, 1e-5, silu_mul, config)
    for g, e in zip(got, expected):
        assert torch.equal(g.float(), e.float())


def test_refuses_a_k_mismatch() -> None:
    a, w, ws = _operands(1, 64, 256, False)
    with pytest.raises(ValueError, match="K mismatch"):
        quantizing_gemm(a, w, ws, silu_mul=True)
