"""The one-token streaming matrix-vector kernel (kiln/models/gemv_stream.py) against a float64 reference (e4m3
weights; e4m3 or 16-bit tokens), its unscaled sums as the add + RMSNorm epilogue's partials, its SiLU-mul, which
calls the GEMM entry points hand it, and the weight-only FP8 ops built on it.
Without a GPU it runs under Triton's CPU interpreter (16-bit operands in fp16: its bf16 loads are wrong there)."""

from __future__ import annotations

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
from kiln.models.quant.fp8 import FP8_DTYPE, quantize_per_token, quantize_weight  # noqa: E402
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


def test_a_16_bit_token_takes_at_least_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit token (weight-only FP8): at least TOKEN16_MIN_ROWS rows a program (fewer programs re-reading it), the
    same weight bytes a K step; an e4m3 token keeps the rule's rows."""
    rule = pick_config(4096, 14336, num_sms=132)
    assert rule.rows == 4 < gemv_stream.TOKEN16_MIN_ROWS == 8
    assert pick_config(4096, 14336, num_sms=132, token_bytes=2) == GemvStreamConfig(8, 512)
    assert pick_config(28672, 4096, num_sms=132, token_bytes=2) == pick_config(28672, 4096, num_sms=132)
    monkeypatch.setattr(gemv_stream, "TOKEN16_MIN_ROWS", 16)  # the launch below at rows the CPU's rule would not pick
    calls: list[tuple[tuple[int], int, int]] = []
    real = gemv_stream._gemv_stream_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, kwargs["R"], kwargs["BLOCK_K"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gemv_stream, "_gemv_stream_kernel", Spy())
    _, wq, _, ws = operands(1, 64, 256, seed=4)
    x16 = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, WIDE)
    got = gemv_stream.gemv_stream(x16, wq, fp8_kernel.flat_scales(None, ws), torch.float32)
    assert calls == [((4,), 16, 256)]  # 64 rows, 16 a program, 4 KB of weight a step
    close(got, products(x16, wq) * ws.double().reshape(1, -1))


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


def weight_only_operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A 16-bit token and an e4m3 weight with its per-channel scale (weight-only FP8)."""
    g = torch.Generator().manual_seed(seed)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    return torch.randn(1, k, generator=g).to(WIDE).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)


def weight_only_products(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return products(x, wq) * ws.double().reshape(1, -1)  # 16-bit and e4m3 values are exact in float64


@pytest.mark.parametrize("n,k,config", CASES, ids=[f"N{n}-K{k}" for n, k, _ in CASES])
def test_a_16_bit_token_against_e4m3_weights_matches_float64(n: int, k: int, config: GemvStreamConfig | None) -> None:
    """Weight-only FP8: no token scale; the projection and its partials."""
    x, wq, ws = weight_only_operands(n, k, seed=n)
    got = gemv_stream.gemv_stream(x, wq, (None, ws), torch.float32, config=config)
    close(got, weight_only_products(x, wq, ws))
    close(gemv_stream.gemv_stream(x, wq, mode=gemv.PARTIALS, config=config)[0], products(x, wq))


def test_the_weight_only_ops_stream_one_token_and_quantize_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """kiln::fp8_weight_only_* where the streaming kernel runs (forced here on the interpreter): the 16-bit token
    against the weight, against float64; where it does not (suspended, more tokens, the CPU) the per-token quantized
    W8A8 values of the graph the fp8_weight_only pass rewrote, bit for bit."""
    import kiln.passes.ops  # noqa: F401 - registers the ops
    from kiln.passes import fp8_weight_only_ops
    from kiln.passes.ops import rms_norm_ref

    ops = torch.ops.kiln
    n, k, eps = 64, 192, 1e-6
    x, wq, ws = weight_only_operands(n, k, seed=11)
    g = torch.Generator().manual_seed(12)
    residual = torch.randn(1, n, generator=g).to(WIDE).to(DEVICE)
    norm_weight = (torch.rand(n, generator=g) + 0.5).to(WIDE).to(DEVICE)

    def run(tokens: torch.Tensor) -> list[torch.Tensor]:
        rows = tokens.shape[0]
        normed, summed = ops.fp8_weight_only_gemm_add_rms_norm(tokens, wq, ws, residual.expand(rows, n).contiguous(),
                                                               norm_weight, eps)
        return [ops.fp8_weight_only_gemm(tokens, wq, ws, tokens.dtype), normed, summed]

    wide = fp8_weight_only_ops.runs_weight_only
    monkeypatch.setattr(fp8_weight_only_ops, "runs_weight_only",
                        lambda t, w: t.shape[0] == 1 and not gemv.is_suspended())
    out, normed, summed = run(x)
    close(out.float(), weight_only_products(x, wq, ws), rtol=2.0**-8)  # rounded to 16 bits
    h = (weight_only_products(x, wq, ws).to(x.dtype) + residual).float()
    torch.testing.assert_close(summed.float(), h, rtol=2.0**-7, atol=1e-6)
    torch.testing.assert_close(normed.float(), rms_norm_ref(h.to(x.dtype), norm_weight, eps).float(), rtol=2.0**-6,
                               atol=1e-6)
    # the row kernel also quantizing the normalised row for a W8A8 projection: the same sum, its scale, e4m3 values
    # within an ulp
    q8, scale, summed_q = ops.fp8_weight_only_gemm_add_rms_norm_quant(x, wq, ws, residual, norm_weight, eps)
    assert torch.equal(summed_q, summed) and q8.dtype == FP8_DTYPE and scale.shape == (1, 1)
    torch.testing.assert_close(scale, normed.float().abs().amax(-1, keepdim=True) / 448, rtol=2.0**-6, atol=0)
    if DEVICE == "cuda":  # the interpreter's e4m3 cast is not the GPU's: there only the scale and the sum
        torch.testing.assert_close(q8.float() * scale, normed.float(), rtol=2.0**-3, atol=scale.item() * 2.0**-6)

    def w8a8(tokens: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_per_token(tokens)
        return ops.fp8_gemm(q, wq, scale, ws, tokens.dtype)

    if DEVICE == "cpu":
        two = torch.cat([x, -x])
        assert torch.equal(run(two)[0], w8a8(two))  # two tokens: the W8A8 path
        with gemv.suspended():
            assert torch.equal(run(x)[0], w8a8(x))
            q, x_scale = quantize_per_token(x)
            want = ops.fp8_gemm_add_rms_norm_quant(q, wq, x_scale, ws, residual, norm_weight, eps)
            for got, expected in zip(ops.fp8_weight_only_gemm_add_rms_norm_quant(x, wq, ws, residual, norm_weight,
                                                                                 eps), want):
                assert torch.equal(got, expected)
        assert not wide(x, wq)  # the CPU never streams
