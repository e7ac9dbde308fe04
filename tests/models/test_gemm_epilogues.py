"""The small-M GEMMs with an epilogue (kiln/models/gemm_epilogues.py) against the unfused arithmetic: the GEMM
rounded to the model dtype, then silu(gate) * up, RoPE, or the residual add and RMSNorm as the model computes
them; the ops that dispatch to them (kiln/passes/ops.py) on both sides of the threshold; and their sm90 compile.
Without a GPU the kernels run under Triton's CPU interpreter in fp16 (its bf16 loads are wrong:
tests/models/test_fp8_kernel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOLERANCE = dict(rtol=2 ** -6 if DTYPE == torch.bfloat16 else 2 ** -8, atol=2e-3)  # a 16-bit ulp or two

if DEVICE == "cpu":
    define_interpreted("kiln.models.quant.fp8_kernel", "kiln.models.gemm_epilogues")

import kiln.passes.ops  # noqa: E402, F401 - registers the ops
from kiln.models.gemm_epilogues import (  # noqa: E402
    fp8_gemm_add_rms_norm_quant_triton,
    gate_up_silu_mul_triton,
    gemm_add_rms_norm_triton,
    qkv_rope_triton,
)
from kiln.models.quant.fp8 import quantize_per_token, quantize_weight  # noqa: E402
from kiln.models.quant.fp8_kernel import Fp8GemmConfig, bf16_gemm_triton, fp8_gemm_triton  # noqa: E402
from kiln.passes.ops import norm_rope_ref, rms_norm_ref  # noqa: E402
from tests.models.test_fp8_kernel import sm90_ptx  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def operands(m: int, n: int, k: int, seed: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype).to(DEVICE),
            (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEVICE))


def rope_cache(positions: int, head_dim: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(positions).float(), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def qkv_rope_reference(x, w, positions, cache, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    head_dim = cache.shape[-1]
    y = (x.double() @ w.double().t()).to(x.dtype)
    q, k, v = (t.reshape(x.shape[0], -1, head_dim) for t in y.split([heads * head_dim, kv_heads * head_dim,
                                                                      kv_heads * head_dim], dim=-1))
    return (*norm_rope_ref(q, k, positions[: x.shape[0]], cache, None, None, 0.0), v)


@pytest.mark.parametrize("m,n,k,config", [
    (1, 96, 200, Fp8GemmConfig(64, 64, 1, 4, 2)),
    (5, 70, 256, Fp8GemmConfig(32, 64, 4, 4, 2)),  # split-K asked for: the epilogue kernels run without it
    (17, 64, 130, Fp8GemmConfig(128, 32, 1, 4, 2)),
])
def test_gate_up_with_silu_mul_in_the_epilogue(m: int, n: int, k: int, config: Fp8GemmConfig) -> None:
    """[gate; up] rows paired per tile: N off the half tile, K off the tile, M over one tile; the GEMM rounded to
    the model dtype, the SiLU and the product in fp32."""
    x, w = operands(m, 2 * n, k, m * 1000 + n)
    out = gate_up_silu_mul_triton(x, w, config)
    gate, up = (x.double() @ w.double().t()).to(DTYPE).chunk(2, dim=-1)
    assert out.dtype == DTYPE and out.shape == (m, n)
    want = (F.silu(gate.float()) * up.float()).to(DTYPE)  # Inductor's arithmetic for the unfused graph
    torch.testing.assert_close(out.double(), want.double(), **TOLERANCE)


@pytest.mark.parametrize("m,heads,kv_heads,head_dim,k,config", [
    (1, 4, 2, 64, 96, Fp8GemmConfig(64, 64, 1, 4, 2)),  # a tile = a head (SmolLM2's 64)
    (3, 2, 1, 128, 200, Fp8GemmConfig(64, 64, 2, 4, 2)),  # two tiles a head (Llama's 128), K off the tile
    (17, 2, 2, 64, 64, Fp8GemmConfig(128, 32, 1, 4, 2)),  # the config's 128 rows cut to the head
    (2, 4, 2, 16, 64, Fp8GemmConfig(64, 64, 1, 4, 2)),  # the tiny test models' 16: the smallest tile
])
def test_qkv_with_rope_in_the_epilogue(m: int, heads: int, kv_heads: int, head_dim: int, k: int,
                                       config: Fp8GemmConfig) -> None:
    """q and k heads rotated by each token's position (not in order, past the first), v heads as computed."""
    x, w = operands(m, (heads + 2 * kv_heads) * head_dim, k, m + heads)
    positions = torch.randperm(64, generator=torch.Generator().manual_seed(m))[:m].to(DEVICE)
    cache = rope_cache(64, head_dim)
    got = qkv_rope_triton(x, w, positions, cache, heads, kv_heads, config)
    for out, want in zip(got, qkv_rope_reference(x, w, positions, cache, heads, kv_heads)):
        assert out.dtype == DTYPE and out.shape == want.shape and out.is_contiguous()
        torch.testing.assert_close(out.double(), want.double(), **TOLERANCE)


@pytest.mark.parametrize("m,n,k,config", [
    (1, 576, 200, Fp8GemmConfig(64, 64, 4, 4, 2)),  # split-K: the row kernel sums the partials
    (3, 100, 256, Fp8GemmConfig(32, 64, 1, 4, 2)),  # one whole-K partial; N off the tile and the row block
    (17, 64, 130, Fp8GemmConfig(64, 32, 2, 4, 2)),  # M over one tile, K off the tile
])
def test_gemm_with_the_residual_add_and_norm_after_it(m: int, n: int, k: int, config: Fp8GemmConfig) -> None:
    """h is exactly the plain small-M GEMM at the same config plus the residual, rounded as the unfused graph's add;
    the normalised row is the model's RMSNorm of h (the sum of squares in another order: an ulp apart at most)."""
    x, w = operands(m, n, k, m + n)
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(m, n, generator=g).to(DTYPE).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(n, generator=g)).to(DTYPE).to(DEVICE)
    normed, summed = gemm_add_rms_norm_triton(x, w, residual, norm_weight, 1e-5, config)
    want_sum = (bf16_gemm_triton(x, w, config).float() + residual.float()).to(DTYPE)
    assert torch.equal(summed, want_sum)
    assert normed.dtype == DTYPE and normed.shape == (m, n)
    torch.testing.assert_close(normed.double(), rms_norm_ref(want_sum, norm_weight, 1e-5).double(), **TOLERANCE)
    with pytest.raises(ValueError, match="residual"):
        gemm_add_rms_norm_triton(x, w, residual[:, :-1], norm_weight, 1e-5, config)


@pytest.mark.parametrize("m,n,k,config", [
    (1, 576, 256, Fp8GemmConfig(64, 128, 2, 4, 2)),  # split-K
    (3, 100, 256, Fp8GemmConfig(32, 128, 1, 4, 2)),  # one whole-K partial; N off the tile
])
def test_fp8_gemm_with_the_add_norm_and_quantization_after_it(m: int, n: int, k: int, config: Fp8GemmConfig) -> None:
    """The FP8 projection into the residual stream: h is exactly kiln's FP8 GEMM at the same config (scales applied
    in its order, rounded to the model dtype) plus the residual; the next layer's input is quantize_per_token of the
    model's RMSNorm of h: its scales (and, on a GPU, its e4m3 values; the interpreter's e4m3 stores are not
    trusted) as the reference's."""
    g = torch.Generator().manual_seed(m + n)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    xq, xs = quantize_per_token(torch.randn(m, k, generator=g))
    xq, wq, xs, ws = (t.to(DEVICE) for t in (xq, wq, xs, ws))
    residual = torch.randn(m, n, generator=g).to(DTYPE).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(n, generator=g)).to(DTYPE).to(DEVICE)
    q, scale, summed = fp8_gemm_add_rms_norm_quant_triton(xq, wq, xs, ws, residual, norm_weight, 1e-5, config)
    want_sum = (fp8_gemm_triton(xq, wq, xs, ws, DTYPE, config).float() + residual.float()).to(DTYPE)
    assert torch.equal(summed, want_sum)
    want_q, want_scale = quantize_per_token(rms_norm_ref(want_sum, norm_weight, 1e-5))
    assert q.dtype == want_q.dtype and q.shape == (m, n) and scale.shape == (m, 1)
    torch.testing.assert_close(scale, want_scale, rtol=2 ** -7, atol=0)
    if DEVICE == "cuda":
        torch.testing.assert_close((q.float() * scale).double(), (want_q.float() * want_scale).double(),
                                   rtol=2 ** -3, atol=2e-3)
    # the op's fake (what Dynamo traces) agrees with it, on the side of M it takes here
    torch.library.opcheck(torch.ops.kiln.fp8_gemm_add_rms_norm_quant.default,
                          (xq, wq, xs, ws, residual, norm_weight, 1e-5), test_utils=("test_faketensor",))


@pytest.mark.parametrize("m", [1, 16, 17])
def test_the_ops_dispatch_on_m(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kiln::gate_up_silu_mul and kiln::qkv_rope: the epilogue kernels up to dense_gemm's TRITON_MAX_M tokens on
    CUDA; the GEMM, then the unfused graph's step, above it and on the CPU: the same values either way."""
    from kiln.models import gemm_epilogues

    calls: list[str] = []
    for name in ("gate_up_silu_mul_triton", "qkv_rope_triton", "gemm_add_rms_norm_triton"):
        original = getattr(gemm_epilogues, name)
        monkeypatch.setattr(gemm_epilogues, name,
                            lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    x, w = operands(m, 144, 96, m, torch.float16)
    got = torch.ops.kiln.gate_up_silu_mul(x, w)
    gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=2 ** -7, atol=2e-3)
    positions, cache = torch.arange(m, device=DEVICE) + 3, rope_cache(32, 16)
    args = (x, w[: (2 + 2 * 2) * 16], positions, cache, 2, 2)
    got = torch.ops.kiln.qkv_rope(*args)
    for out, want in zip(got, qkv_rope_reference(*args)):
        torch.testing.assert_close(out.double(), want.double(), rtol=2 ** -7, atol=2e-3)
    residual, norm_weight = torch.randn(m, 144, device=DEVICE).half(), torch.rand(144, device=DEVICE).half() + 0.5
    normed, summed = torch.ops.kiln.gemm_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    want_sum = (x.double() @ w.double().t() + residual.double()).half()
    torch.testing.assert_close(summed.double(), want_sum.double(), rtol=2 ** -7, atol=2e-3)
    torch.testing.assert_close(normed.double(), rms_norm_ref(summed, norm_weight, 1e-6).double(), rtol=2 ** -7,
                               atol=2e-3)
    fused = DEVICE == "cuda" and m <= 16
    assert calls == (["gate_up_silu_mul_triton", "qkv_rope_triton", "gemm_add_rms_norm_triton"] if fused else [])
    # the fakes (what Dynamo traces) agree with the ops (opcheck runs them again, so after the count above)
    torch.library.opcheck(torch.ops.kiln.gate_up_silu_mul.default, (x, w), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.kiln.qkv_rope.default, args, test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.kiln.gemm_add_rms_norm.default, (x, w, residual, norm_weight, 1e-6),
                          test_utils=("test_faketensor",))


def test_heads_that_do_not_tile_are_refused_by_name() -> None:
    from kiln.models.gemm_epilogues import fits_a_tile

    assert [d for d in (8, 16, 48, 64, 80, 128, 256) if fits_a_tile(d)] == [16, 64, 128, 256]
    x, w = operands(1, 3 * 48, 32, 0)
    with pytest.raises(ValueError, match="head_dim 48"):
        qkv_rope_triton(x, w, torch.zeros(1, dtype=torch.int64, device=DEVICE), rope_cache(4, 48), 1, 1)


@pytest.mark.parametrize("kernel", ["gate_up", "qkv_rope"])
def test_epilogue_kernels_compile_for_hopper_to_pipelined_wgmma(kernel: str) -> None:
    """Ahead-of-time compile for sm90 (no GPU needed): the gathered weight rows still stream through multi-stage
    async copies into bf16 wgmma, and the launch takes part in PDL."""
    ptx = sm90_ptx(kernel)
    assert ptx["wgmma"] and ptx["bf16"] and ptx["cp_async"], ptx
    assert ptx["shared"] >= 3 * (64 * 128 + 16 * 128) * 2, ptx  # several stages of a W and an X tile in flight
    assert ptx["gdc_wait"] and ptx["gdc_launch"] and ptx["launch_pdl"], ptx


@pytest.mark.parametrize("kernel", ["rows", "rows_fp8"])
def test_the_add_norm_row_kernel_compiles_for_hopper_with_pdl(kernel: str) -> None:
    """Ahead-of-time compile for sm90 of the row kernel after the split-K GEMM (the FP8 form writing e4m3): it
    compiles (the interpreter accepts code a GPU compile rejects), takes part in PDL, loads its weights (the norm's,
    the FP8 scales) before the wait and nothing once the row's reductions have begun (a load there is a DRAM round
    trip the kernel's end waits for)."""
    ptx = sm90_ptx(kernel)
    assert ptx["bf16"] and ptx["e4m3"] == (kernel == "rows_fp8"), ptx
    assert ptx["gdc_wait"] and ptx["gdc_launch"] and ptx["launch_pdl"], ptx
    assert ptx["ld_v4_before_wait"] > 0 and ptx["ld_after_barrier"] == 0, ptx
