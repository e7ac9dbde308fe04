"""kiln's Triton FP8 GEMM (kiln/models/quant/fp8_kernel.py) against a float64 reference of the same formula, and
the `kiln::fp8_gemm` op's CPU path against `_scaled_mm`. Without a GPU the kernel runs under Triton's CPU
interpreter (TRITON_INTERPRET=1), which executes float8 tl.dot; on a GPU the same tests run compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_KERNEL_MODULE = "kiln.models.quant.fp8_kernel"

if DEVICE == "cpu":  # the kernels defined interpreted; the fixture below sets the flag during each test
    define_interpreted(_KERNEL_MODULE)

from kiln.models.quant.fp8 import quantize_per_token, quantize_weight  # noqa: E402
from kiln.models.quant.fp8_gemm import scaled_mm  # noqa: E402
from kiln.models.quant.fp8_kernel import Fp8GemmConfig, block_m_for, fp8_gemm_triton, pick_config  # noqa: E402

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random e4m3 activations/weights with their scales, quantized by kiln's own helpers."""
    g = torch.Generator().manual_seed(seed)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    xq, xs = quantize_per_token(torch.randn(m, k, generator=g))
    return tuple(t.to(DEVICE) for t in (xq, wq, xs, ws))


def reference(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The formula in float64: (xq @ wq^T) * x_scale[m] * w_scale[n]; e4m3 values are exact in float64."""
    return (xq.double() @ wq.double().t()) * xs.double().reshape(-1, 1) * ws.double().reshape(1, -1)


# (M, N, K, config): M below/at/above the 16-row tile and over 64 (several M tiles); N and K that are not
# multiples of the tile; split-K that divides K evenly, unevenly, and with an empty last split
CASES = [
    (1, 64, 256, Fp8GemmConfig(block_n=64, block_k=128, split_k=1)),
    (3, 80, 300, Fp8GemmConfig(block_n=32, block_k=64, split_k=1)),
    (16, 96, 512, Fp8GemmConfig(block_n=32, block_k=64, split_k=4)),
    (17, 96, 520, Fp8GemmConfig(block_n=64, block_k=64, split_k=3)),
    (33, 40, 200, Fp8GemmConfig(block_n=32, block_k=32, split_k=5)),
    (70, 48, 128, Fp8GemmConfig(block_n=32, block_k=64, split_k=2)),
    (5, 128, 1024, None),  # the heuristic's own choice
    (40, 64, 512, Fp8GemmConfig(block_n=64, block_k=128, split_k=2, promote=32)),  # four fp32 adds a K step
    (9, 64, 320, Fp8GemmConfig(block_n=32, block_k=64, promote=0)),  # Triton's default: none
]


def test_config_rejects_a_negative_promotion_interval() -> None:
    with pytest.raises(ValueError, match="promote"):
        Fp8GemmConfig(block_n=64, block_k=128, promote=-1)


@pytest.mark.parametrize("m,n,k,config", CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}" for c in CASES])
def test_kernel_matches_float64_reference(m: int, n: int, k: int, config: Fp8GemmConfig | None) -> None:
    if DEVICE == "cuda":  # seen on the H200, 2026-11-30: up to 1.7e-3 relative off float64 (imprecise accumulation)
        pytest.skip("Hopper's fp8 MMA sums each group of products in reduced precision before the fp32 promotion, "
                    "so fp32-exactness holds in the interpreter only; tests/gpu/test_fp8_gpu.py holds the GPU "
                    "kernel to _scaled_mm and to float64 norm-wise")
    xq, wq, xs, ws = operands(m, n, k, seed=m * 7 + k)
    got = fp8_gemm_triton(xq, wq, xs, ws, torch.float32, config)
    expected = reference(xq, wq, xs, ws)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 accumulation over K terms: a few ulps of the row's magnitude
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_kernel_bf16_output_is_the_rounded_fp32_result() -> None:
    xq, wq, xs, ws = operands(9, 72, 384, seed=3)
    config = Fp8GemmConfig(block_n=32, block_k=64, split_k=2)
    got = fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16, config)
    expected = reference(xq, wq, xs, ws)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of the fp32 result: round-to-nearest on the GPU (half an ulp, 2^-8 relative); the CPU
    # interpreter's fp32 -> bf16 cast truncates (up to a whole ulp, 2^-7)
    ulps = 0.5 if DEVICE == "cuda" else 1.0
    torch.testing.assert_close(got.double(), expected, rtol=ulps * 2.0**-7 + 1e-5, atol=1e-6)


def test_kernel_agrees_with_scaled_mm_on_the_same_operands() -> None:
    xq, wq, xs, ws = operands(12, 96, 640, seed=11)
    got = fp8_gemm_triton(xq, wq, xs, ws, torch.float32, Fp8GemmConfig(block_n=32, block_k=64, split_k=3))
    out_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    expected = scaled_mm(xq, wq, xs, ws, out_dtype).float()
    rtol = 2.0**-8 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_split_k_reduction_is_deterministic() -> None:
    xq, wq, xs, ws = operands(4, 64, 1024, seed=5)
    config = Fp8GemmConfig(block_n=32, block_k=64, split_k=4)
    first = fp8_gemm_triton(xq, wq, xs, ws, torch.float32, config)
    assert all(torch.equal(first, fp8_gemm_triton(xq, wq, xs, ws, torch.float32, config)) for _ in range(2))


def test_mismatched_k_is_named() -> None:
    xq, wq, xs, ws = operands(2, 32, 128, seed=0)
    with pytest.raises(ValueError, match="weight"):
        fp8_gemm_triton(xq, wq[:, :64], xs, ws, torch.float32)


@pytest.mark.parametrize("proj", sorted(LLAMA3_8B))
@pytest.mark.parametrize("m", [1, 8, 64])
def test_heuristic_fills_an_h200_without_tiny_splits(proj: str, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback rule (shapes the measured TUNED table does not list; emptied here to reach the rule)."""
    from kiln.models.quant import fp8_kernel

    monkeypatch.setattr(fp8_kernel, "TUNED", {})
    n, k = LLAMA3_8B[proj]
    config = pick_config(m, n, k, num_sms=132)
    tiles = -(-n // config.block_n) * -(-m // block_m_for(m))
    assert tiles * config.split_k >= 132, (proj, m, config)  # at least one program per SM
    assert k // config.split_k >= 4 * config.block_k  # every split pipelines over a few K steps


def test_measured_tables_win_over_the_rule_per_operand_width() -> None:
    """A shape in TUNED takes its measured config at every M up to the entry's M (the next larger entry's
    otherwise); 16-bit operands look in TUNED_16BIT instead (TUNED was measured for e4m3), where one config
    serves every M <= 16 so that a verify of up to 16 tokens sums as a decode does."""
    from kiln.models.quant.fp8_kernel import TUNED, TUNED_16BIT

    (n, k, _), _ = next(iter(TUNED.items()))
    entries = sorted((max_m, cfg) for (tn, tk, max_m), cfg in TUNED.items() if (tn, tk) == (n, k))
    for m in (1, 3, 64):
        assert pick_config(m, n, k, num_sms=132) == next(cfg for max_m, cfg in entries if m <= max_m)
    assert pick_config(1, n, k, num_sms=132, element_bytes=2).block_k == 128
    for (n, k, max_m), config in TUNED_16BIT.items():
        assert max_m >= 16 and (n, k, 1) not in TUNED_16BIT
        assert {pick_config(m, n, k, num_sms=132, element_bytes=2) for m in (1, 9, 16)} == {config}
        assert pick_config(1, n, k, num_sms=132).block_k == 256  # e4m3 operands take the rule here


def test_a_swept_table_comes_before_the_shipped_ones(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KILN_GEMM_CONFIGS: what `bench_gemm --table-out` wrote wins for its shapes; a later sweep of the same shape
    replaces its entries there, other shapes' entries stay, and shapes it lacks keep the shipped configs."""
    from benchmarks.bench_gemm import write_table
    from kiln.models.quant import fp8_kernel
    # the module as it stands now (a test module that runs it under the interpreter loads it again)
    pick_config, swept_tables, config_type = fp8_kernel.pick_config, fp8_kernel.swept_tables, fp8_kernel.Fp8GemmConfig

    (n16, k16, _), shipped16 = next(iter(fp8_kernel.TUNED_16BIT.items()))
    narrow, wide = config_type(16, 64, 1, 2, 10), config_type(128, 64, 2, 8, 3)

    def entry(n: int, k: int, max_m: int, config) -> dict:
        return dict(N=n, K=k, max_m=max_m, config=dict(block_n=config.block_n, block_k=config.block_k,
                                                        split_k=config.split_k, num_warps=config.num_warps,
                                                        num_stages=config.num_stages))

    path = str(tmp_path / "gemm.json")
    write_table(path, {"fp8": [entry(512, 256, 1, wide)], "16bit": [entry(n16, k16, 16, wide)]})
    write_table(path, {"fp8": [], "16bit": [entry(n16, k16, 16, narrow), entry(300, 200, 16, wide)]})
    monkeypatch.setenv("KILN_GEMM_CONFIGS", path)
    swept_tables.cache_clear()
    try:
        assert pick_config(4, n16, k16, num_sms=132, element_bytes=2) == narrow  # the later sweep's
        assert pick_config(1, 300, 200, num_sms=132, element_bytes=2) == wide
        assert pick_config(1, 512, 256, num_sms=132) == wide
        assert pick_config(2, 512, 256, num_sms=132) != wide  # past the entry's M: the rule
        (n8, k8, max_m), shipped = next(iter(fp8_kernel.TUNED.items()))
        assert pick_config(max_m, n8, k8, num_sms=132) == shipped
    finally:
        monkeypatch.delenv("KILN_GEMM_CONFIGS")
        swept_tables.cache_clear()
    assert pick_config(4, n16, k16, num_sms=132, element_bytes=2) == shipped16


def test_op_on_cpu_is_scaled_mm() -> None:
    from kiln.models.quant import fp8_gemm  # noqa: F401 - registers kiln::fp8_gemm

    g = torch.Generator().manual_seed(1)
    wq, ws = quantize_weight(torch.randn(24, 64, generator=g))
    xq, xs = quantize_per_token(torch.randn(5, 64, generator=g))
    got = torch.ops.kiln.fp8_gemm(xq, wq, xs, ws, torch.float32)
    assert torch.equal(got, scaled_mm(xq, wq, xs, ws, torch.float32))
    # the fake (what Dynamo traces) agrees with the real op; opcheck's schema test cannot multiply e4m3 on CPU
    torch.library.opcheck(torch.ops.kiln.fp8_gemm.default, (xq, wq, xs, ws, torch.float32),
                          test_utils=("test_faketensor",))


def sm90_ptx(*args: str) -> dict:
    """What tests/models/fp8_kernel_sm90.py reports for a kernel compiled for sm90 (skips without ptxas)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.models.fp8_kernel_sm90", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False, cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_m,split,pdl", [(16, False, True), (64, True, False)])
def test_kernel_compiles_for_hopper_to_pipelined_fp8_wgmma(block_m: int, split: bool, pdl: bool) -> None:
    """Ahead-of-time compile for sm90 (no GPU needed): the tile must become fp8 wgmma fed by multi-stage async
    copies, or the kernel cannot stream the weight at bandwidth (a mask along K, say, silently drops that); with
    PDL (kiln/models/pdl.py) its launch is marked so and it waits for, then releases, its neighbours; the scales
    are loaded before the K loop, not after it (where they would cost every program a DRAM round trip at its end)."""
    ptx = sm90_ptx(str(block_m), str(int(split)), str(int(pdl)))
    assert ptx["wgmma"] and ptx["e4m3"] and ptx["cp_async"], ptx
    stage_bytes = 64 * 256 + block_m * 256  # one W tile and one X tile of e4m3
    assert ptx["shared"] >= 3 * stage_bytes, ptx  # several stages in flight, not one buffer
    assert ptx["gdc_wait"] == ptx["gdc_launch"] == ptx["launch_pdl"] == pdl, ptx
    assert ptx["ld_after_barrier"] == 0, ptx


def test_promotion_interval_sets_the_fp32_adds_of_a_k_step() -> None:
    """Ahead-of-time for sm90: the e4m3 MMA's partial sums go to the fp32 accumulator every `promote` products, so a
    K step of 256 makes 8 rounds of adds at 32, 2 at 128, none at 0 (Triton's default: the whole loop imprecise)."""
    adds = {promote: sm90_ptx("16", "0", "1", str(promote))["add_f32"] for promote in (0, 32, 128)}
    assert adds[128] > adds[0] and adds[32] - adds[0] == 4 * (adds[128] - adds[0]), adds


@pytest.mark.parametrize("m,n,k,config", [
    (1, 96, 200, Fp8GemmConfig(32, 64, 1, 4, 2)),
    (5, 70, 256, Fp8GemmConfig(64, 64, 2, 4, 2)),
    (17, 64, 130, Fp8GemmConfig(64, 32, 3, 4, 2)),
])
def test_bf16_path_matches_a_float64_matmul(m: int, n: int, k: int, config: Fp8GemmConfig) -> None:
    """The same kernel on 16-bit operands without scales (the bf16 GEMV candidate): x @ w^T, fp32 accumulation,
    with and without split-K and with N and K off the tile. bf16 on a GPU; fp16 under the CPU interpreter,
    whose bf16 loads are wrong (numpy has no bf16: it returned values off by 1e11 for the fp32-exact inputs
    that fp16 and fp32 get right), so there the same code runs on the other 16-bit type."""
    from kiln.models.quant.fp8_kernel import bf16_gemm_triton

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEVICE)
    out = bf16_gemm_triton(x, w, config)
    want = x.double() @ w.double().t()
    assert out.dtype == dtype and out.shape == (m, n)
    # one 16-bit rounding of an fp32 sum (the interpreter's cast truncates: a whole ulp)
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10, atol=1e-3)


def test_cpu_fallback_without_rowwise_scaled_mm_matches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only; the fallback (the same e4m3 products in fp32,
    scaled after) must give what the row-wise _scaled_mm gives where it exists."""
    from kiln.models.quant import fp8_gemm

    if not fp8_gemm.CPU_ROWWISE:
        pytest.skip("this torch's CPU _scaled_mm has no row-wise scales to compare with")
    g = torch.Generator().manual_seed(3)
    wq, ws = quantize_weight(torch.randn(40, 96, generator=g))
    xq, xs = quantize_per_token(torch.randn(7, 96, generator=g))
    expected = fp8_gemm.scaled_mm(xq, wq, xs, ws, torch.float32)
    monkeypatch.setattr(fp8_gemm, "CPU_ROWWISE", False)
    got = fp8_gemm.scaled_mm(xq, wq, xs, ws, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_dense_gemm_op_dispatches_on_m_and_matches_mm(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kiln::dense_gemm (the 16-bit projections' GEMM on CUDA): the Triton kernel up to TRITON_MAX_M tokens,
    torch.mm above, the same product either way (fp16 here: the interpreter mis-loads bf16)."""
    from kiln.models import dense_gemm
    from kiln.models.quant import fp8_kernel

    calls: list[int] = []
    original = fp8_kernel.bf16_gemm_triton
    monkeypatch.setattr(fp8_kernel, "bf16_gemm_triton", lambda x, w, *a: calls.append(x.shape[0]) or original(x, w, *a))
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(torch.float16).to(DEVICE)
    w = (torch.randn(72, 96, generator=g) * 0.05).to(torch.float16).to(DEVICE)
    got = torch.ops.kiln.dense_gemm(x, w)
    torch.testing.assert_close(got.float(), (x.double() @ w.double().t()).float(), rtol=2 ** -9, atol=2e-3)
    assert dense_gemm.TRITON_MAX_M == 16  # the measured threshold the docstring states
    assert calls == ([m] if m <= 16 else [])
    torch.library.opcheck(torch.ops.kiln.dense_gemm.default, (x, w), test_utils=("test_faketensor",))
