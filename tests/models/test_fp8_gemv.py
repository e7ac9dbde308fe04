"""The one-token FP8 matrix-vector kernel (kiln/models/quant/fp8_gemv.py) against a float64 reference, its unscaled
sums as the add + RMSNorm epilogue's partials, and which calls the FP8 entry points hand it. Without a GPU it runs
under Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    define_interpreted("kiln.models.gemv", "kiln.models.quant.fp8_gemv", "kiln.models.quant.fp8_kernel",
                       "kiln.models.gemm_epilogues")

from kiln.models import gemm_epilogues, gemv  # noqa: E402
from kiln.models.quant import fp8_gemv, fp8_kernel  # noqa: E402
from kiln.models.quant.fp8 import quantize_per_token, quantize_weight  # noqa: E402
from kiln.models.quant.fp8_gemv import Fp8GemvConfig, pick_config  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    xq, xs = quantize_per_token(torch.randn(m, k, generator=g))
    return tuple(t.to(DEVICE) for t in (xq, wq, xs, ws))


def products(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    return xq.double() @ wq.double().t()  # e4m3 values and their products are exact in float64


# N not a multiple of the rows, K not of the K step; both multiples (the unmasked loads); the rule's own config
CASES = [(70, 300, Fp8GemvConfig(4, 64)), (64, 256, Fp8GemvConfig(8, 64, num_warps=2)), (96, 512, None)]


@pytest.mark.parametrize("n,k,config", CASES, ids=[f"N{n}-K{k}" for n, k, _ in CASES])
def test_scaled_output_and_partials_match_float64(n: int, k: int, config: Fp8GemvConfig | None) -> None:
    xq, wq, xs, ws = operands(1, n, k, seed=n + k)
    flat = fp8_kernel.flat_scales(xs, ws)
    got = fp8_gemv.fp8_gemv(xq, wq, flat, torch.float32, config)
    expected = products(xq, wq) * xs.double() * ws.double().reshape(1, -1)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    partials = fp8_gemv.fp8_gemv(xq, wq, None, torch.float32, config)
    assert partials.shape == (1, 1, n) and partials.dtype == torch.float32
    sums = products(xq, wq)
    torch.testing.assert_close(partials[0].double(), sums, rtol=1e-5, atol=1e-5 * sums.abs().max().item())


def test_more_than_one_token_is_refused() -> None:
    xq, wq, xs, ws = operands(2, 32, 64, seed=1)
    with pytest.raises(ValueError, match="q: one token"):
        fp8_gemv.fp8_gemv(xq, wq, fp8_kernel.flat_scales(xs, ws), torch.float32)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (96, 64)])
def test_the_rule_spreads_programs_over_the_sms(n: int, k: int) -> None:
    config = pick_config(n, k, num_sms=132)
    programs = -(-n // config.rows)
    assert 1 <= config.rows <= 16 and (programs >= 4 * 132 or config.rows == 1)
    assert config.block_k <= max(16, 4096 // config.rows) and config.block_k & (config.block_k - 1) == 0


def test_one_token_fp8_calls_take_it_where_enabled_and_not_suspended(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_gemm_triton and the FP8 add + RMSNorm + quantization epilogue at M = 1 run the kernel when KILN_FP8_GEMV
    is on, with the values of the MMA kernel's path (up to summation order); never under gemv.suspended() (a runner
    that speculates), at M > 1, or with an explicit MMA config."""
    calls: list[int] = []
    real = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    n, k = 48, 192
    xq, wq, xs, ws = operands(1, n, k, seed=4)
    residual = torch.randn(1, n, generator=torch.Generator().manual_seed(5)).to(torch.float32).to(DEVICE)
    norm_weight = torch.rand(n, generator=torch.Generator().manual_seed(6)).to(DEVICE) + 0.5

    def run() -> list[torch.Tensor]:
        out = fp8_kernel.fp8_gemm_triton(xq, wq, xs, ws, torch.float32)
        normed, scale, summed = gemm_epilogues.fp8_gemm_add_rms_norm_quant_triton(xq, wq, xs, ws, residual,
                                                                                   norm_weight, 1e-6)
        return [out, normed.float(), scale, summed]

    monkeypatch.setattr(fp8_gemv, "ENABLED", False)
    mma = run()
    assert calls == []
    monkeypatch.setattr(fp8_gemv, "ENABLED", True)
    got = run()
    assert calls == [1, 1]
    # the fp32 results, up to summation order; on a GPU also up to Hopper's fp8 MMA, which sums each group of
    # products in reduced precision before promoting to fp32 (up to 1.7e-3 relative off float64 on the H200)
    rtol = 4e-3 if DEVICE == "cuda" else 1e-5
    for a, b in zip(got[:1] + got[2:], mma[:1] + mma[2:]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    # the e4m3 values: a sum a few ulps apart may round to the neighbouring e4m3 value (3 mantissa bits)
    torch.testing.assert_close(got[1], mma[1], rtol=2.0**-3, atol=0.0)
    with gemv.suspended():
        run()
    xq2, wq2, xs2, ws2 = operands(2, n, k, seed=7)
    fp8_kernel.fp8_gemm_triton(xq2, wq2, xs2, ws2, torch.float32)
    fp8_kernel.fp8_gemm_triton(xq, wq, xs, ws, torch.float32, fp8_kernel.Fp8GemmConfig(32, 64))
    assert calls == [1, 1]
