"""The one-token streaming matrix-vector kernel (kiln/models/gemv_stream.py) against a float64 reference (e4m3
weights), its unscaled sums as the add + RMSNorm epilogue's partials, and which calls the GEMM entry points hand it.
Without a GPU it runs under Triton's CPU interpreter (16-bit operands in fp16: its bf16 loads are wrong there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
if DEVICE == "cpu":
    define_interpreted("kiln.models.gemv", "kiln.models.gemv_stream", "kiln.models.quant.fp8_kernel",
                       "kiln.models.gemm_epilogues")

from kiln.models import gemm_epilogues, gemv, gemv_stream  # noqa: E402
from kiln.models.gemv_stream import GemvStreamConfig, pick_config  # noqa: E402
from kiln.models.quant import fp8_kernel  # noqa: E402
from tests.models.test_fp8_kernel import operands  # noqa: E402 - e4m3 operands and scales, kiln's quantizers


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()  # e4m3 values and their products are exact in float64


def close(got: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# N not a multiple of the rows, K not of the K step; both multiples (the unmasked loads); the rule's own config
CASES = [(70, 300, GemvStreamConfig(4, 64)), (64, 256, GemvStreamConfig(8, 64, num_warps=2)), (96, 512, None)]


@pytest.mark.parametrize("n,k,config", CASES, ids=[f"N{n}-K{k}" for n, k, _ in CASES])
def test_fp8_output_and_partials_match_float64(n: int, k: int, config: GemvStreamConfig | None) -> None:
    xq, wq, xs, ws = operands(1, n, k, seed=n + k)
    got = gemv_stream.gemv_stream(xq, wq, fp8_kernel.flat_scales(xs, ws), torch.float32, config=config)
    assert got.shape == (1, n) and got.dtype == torch.float32
    close(got, products(xq, wq) * xs.double() * ws.double().reshape(1, -1))
    partials = gemv_stream.gemv_stream(xq, wq, mode=gemv.PARTIALS, config=config)
    assert partials.shape == (1, 1, n) and partials.dtype == torch.float32
    close(partials[0], products(xq, wq))


def test_more_than_one_token_is_refused() -> None:
    xq, wq, xs, ws = operands(2, 32, 64, seed=1)
    with pytest.raises(ValueError, match="x: one token"):
        gemv_stream.gemv_stream(xq, wq, fp8_kernel.flat_scales(xs, ws), torch.float32)
    with pytest.raises(ValueError, match="scales"):  # the output is scaled: only partials go without
        gemv_stream.gemv_stream(xq[:1], wq, out_dtype=torch.float32)


@pytest.mark.parametrize("element_bytes", [1, 2])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (5120, 2048), (96, 64)])
def test_the_rule_spreads_programs_over_the_sms(n: int, k: int, element_bytes: int) -> None:
    config = pick_config(n, k, num_sms=132, element_bytes=element_bytes)
    programs = -(-n // config.rows)
    assert 1 <= config.rows <= 16 and (programs >= 4 * 132 or config.rows == 1)
    step_bytes = config.rows * config.block_k * element_bytes
    assert step_bytes <= max(4096, 16 * config.rows * element_bytes) and config.block_k & (config.block_k - 1) == 0


def test_the_rule_can_be_set_for_an_ab() -> None:
    """KILN_GEMV_STREAM_RULE=PROGRAMS_PER_SM:TILE_BYTES replaces the rule's two numbers (an A/B arm); a malformed
    value is refused naming the variable."""
    code = "from kiln.models.gemv_stream import pick_config; c = pick_config(6144, 4096, 132); print(c.rows, c.block_k)"
    run = (lambda rule: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       env={**os.environ, "KILN_GEMV_STREAM_RULE": rule}))
    assert run("4:8192").stdout.split() == ["8", "1024"]  # 768 programs (>= 4 an SM), 8 KB a step
    assert run("8:4096").stdout.split() == ["4", "1024"]  # 1536 programs (>= 8 an SM), 4 KB a step
    bad = run("4")
    assert bad.returncode != 0 and "KILN_GEMV_STREAM_RULE" in bad.stderr


def test_one_token_calls_take_it_where_enabled_and_not_suspended(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_gemm_triton and the FP8 add + RMSNorm + quantization epilogue at M = 1 run the kernel when enabled, with
    the values of the MMA kernel's path (up to summation order); never for 16-bit weights (bf16_gemm_triton past what
    gemv.py takes), under gemv.suspended() (a runner that speculates), at M > 1, or with an explicit MMA config."""
    calls: list[int] = []
    real = gemv_stream.gemv_stream
    monkeypatch.setattr(gemv_stream, "gemv_stream",
                        lambda x, *a, **kw: calls.append(x.element_size()) or real(x, *a, **kw))
    monkeypatch.setattr(gemv, "MAX_K", 64)  # the 16-bit operand below is past what gemv.py's kernel takes
    n, k = 48, 192
    xq, wq, xs, ws = operands(1, n, k, seed=4)
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(1, n, generator=g).to(DEVICE)
    norm_weight = torch.rand(n, generator=g).to(DEVICE) + 0.5
    x16, w16 = torch.randn(1, k, generator=g).to(WIDE).to(DEVICE), (torch.randn(n, k, generator=g) * 0.05).to(WIDE)

    def run() -> list[torch.Tensor]:
        out = fp8_kernel.fp8_gemm_triton(xq, wq, xs, ws, torch.float32)
        normed, scale, summed = gemm_epilogues.fp8_gemm_add_rms_norm_quant_triton(xq, wq, xs, ws, residual,
                                                                                   norm_weight, 1e-6)
        return [out, normed.float(), scale, summed, fp8_kernel.bf16_gemm_triton(x16, w16.to(DEVICE)).float()]

    monkeypatch.setattr(gemv_stream, "FP8_ENABLED", False)
    mma = run()
    assert calls == []
    monkeypatch.setattr(gemv_stream, "FP8_ENABLED", True)
    got = run()
    assert calls == [1, 1]
    # the fp32 results, up to summation order; on a GPU also up to Hopper's fp8 MMA, which sums each group of
    # products in reduced precision before promoting to fp32 (up to 1.7e-3 relative off float64 on the H200)
    rtol = 4e-3 if DEVICE == "cuda" else 1e-5
    for a, b in zip(got[:1] + got[2:4], mma[:1] + mma[2:4]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    # rounded values: a sum a few ulps apart may round to the neighbouring e4m3 (3 mantissa bits) or 16-bit value
    torch.testing.assert_close(got[1], mma[1], rtol=2.0**-3, atol=0.0)
    assert torch.equal(got[4], mma[4])  # the same kernel
    with gemv.suspended():
        run()
    xq2, wq2, xs2, ws2 = operands(2, n, k, seed=7)
    fp8_kernel.fp8_gemm_triton(xq2, wq2, xs2, ws2, torch.float32)
    fp8_kernel.fp8_gemm_triton(xq, wq, xs, ws, torch.float32, fp8_kernel.Fp8GemmConfig(32, 64))
    assert calls == [1, 1]


def test_on_by_default_only_where_it_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, KILN_FP8_GEMV leaves the kernel to the GPUs it beat the MMA kernel on (the H100), not the H200, an
    unmeasured GPU or the CPU; set, it decides anywhere; 16-bit weights and M > 1 never take it."""
    monkeypatch.setattr(gemv_stream, "FP8_ENABLED", None)
    gemv_stream._faster_on.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device.index])
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA L40S"}
    on = [gemv_stream.applies(1, 1, torch.device("cuda", i)) for i in range(3)]
    assert on == [True, False, False] and not gemv_stream.applies(1, 1, torch.device("cpu"))
    h100 = torch.device("cuda", 0)
    assert not gemv_stream.applies(1, 2, h100) and not gemv_stream.applies(2, 1, h100)
    monkeypatch.setattr(gemv_stream, "FP8_ENABLED", True)
    assert gemv_stream.applies(1, 1, torch.device("cuda", 1)) and gemv_stream.applies(1, 1, torch.device("cpu"))
    monkeypatch.setattr(gemv_stream, "FP8_ENABLED", False)
    assert not gemv_stream.applies(1, 1, h100)
    gemv_stream._faster_on.cache_clear()
