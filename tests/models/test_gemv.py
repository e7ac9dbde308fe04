"""The small projections' matrix-vector kernel (kiln/models/gemv.py) against float64 products and the unfused
arithmetic; a token's sums the same at any M (what keeps a speculative verify equal to a decode); and which shapes
the GEMM entry points hand it. Without a GPU it runs under Triton's CPU interpreter in fp16 (its bf16 loads are
wrong: tests/models/test_fp8_kernel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOLERANCE = dict(rtol=2 ** -6 if DTYPE == torch.bfloat16 else 2 ** -8, atol=2e-3)

if DEVICE == "cpu":
    define_interpreted("kiln.models.gemv", "kiln.models.quant.fp8_kernel", "kiln.models.gemm_epilogues")

from kiln.models import gemm_epilogues, gemv  # noqa: E402
from kiln.models.quant import fp8_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gemv, "ENABLED", True)  # the default, whatever KILN_GEMV the environment holds


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(DTYPE).to(DEVICE),
            (torch.randn(n, k, generator=g) * 0.1).to(DTYPE).to(DEVICE))


@pytest.mark.parametrize("m,n,k", [(1, 72, 96), (3, 100, 576), (16, 40, 1536), (5, 9, 2048)])
def test_projection_and_sums_match_a_float64_matmul(m: int, n: int, k: int) -> None:
    """N off the row block, K off a power of two (SmolLM2's 576 and 1536) and at the largest K taken."""
    x, w = operands(m, n, k, m + n + k)
    want = x.double() @ w.double().t()
    out = gemv.gemv(x, w)
    assert out.dtype == DTYPE and out.shape == (m, n)
    torch.testing.assert_close(out.double(), want, **TOLERANCE)
    sums = gemv.gemv(x, w, gemv.PARTIALS)
    assert sums.dtype == torch.float32 and sums.shape == (1, m, n)
    torch.testing.assert_close(sums[0].double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(out, sums[0].to(DTYPE))  # the output is its sums rounded once


def test_silu_mul_of_gate_and_up_rows() -> None:
    """Weight rows gate then up: silu(gate) * up with each projection rounded to the model dtype first, as the
    unfused graph's GEMM output is."""
    m, n, k = 3, 50, 576
    x, w = operands(m, 2 * n, k, 7)
    out = gemv.gemv(x, w, gemv.SILU_MUL)
    gate, up = gemv.gemv(x, w).chunk(2, dim=-1)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double(), (F.silu(gate.float()) * up.float()).to(DTYPE).double(), **TOLERANCE)


def test_a_tokens_sums_do_not_depend_on_the_batch() -> None:
    """Row i of an M-token call is bit for bit the call of token i alone, in every mode and after a norm."""
    x, w = operands(16, 64, 576, 11)
    for mode in (gemv.OUT, gemv.PARTIALS, gemv.SILU_MUL):
        batch = gemv.gemv(x, w, mode)
        for i in (0, 5, 15):
            alone = gemv.gemv(x[i:i + 1], w, mode)
            assert torch.equal(batch[..., i:i + 1, :], alone)
    norm_weight = torch.ones(64, dtype=DTYPE, device=DEVICE)
    partials = gemv.gemv(x, w, gemv.PARTIALS)
    _, w_next = operands(1, 32, 64, 12)
    out, h, normed = gemv.gemv_after_norm(partials, x[:, :64].contiguous(), norm_weight, 1e-5, w_next)
    alone, h_alone, normed_alone = gemv.gemv_after_norm(partials[:, 15:], x[15:, :64].contiguous(), norm_weight,
                                                        1e-5, w_next)
    assert torch.equal(out[15:], alone) and torch.equal(h[15:], h_alone) and torch.equal(normed[15:], normed_alone)


def test_calls_taken_and_the_entry_points_that_hand_them_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token, 16-bit weights with K <= MAX_K and at most MAX_BYTES, outside `suspended()`; the plain GEMM, the
    epilogues' sums and the SiLU-mul epilogue then give the kernel's results exactly; two tokens, an explicit tile
    config, a suspended block or KILN_GEMV=0 keep the MMA kernel."""
    assert gemv.applies(1, 960, 576, 2) and gemv.applies(1, 3072, 576, 2) and gemv.applies(1, 576, 1536, 2)
    assert not gemv.applies(2, 960, 576, 2)  # its weights re-read a token: the MMA kernel's
    assert not gemv.applies(1, 4096, 4096, 2)  # K past the registers' tile
    assert not gemv.applies(1, 5120, 2048, 2)  # 21 MB: streaming, not latency
    assert not gemv.applies(1, 960, 576, 1)  # FP8 stays on its kernel
    x, w = operands(1, 96, 192, 3)
    assert torch.equal(fp8_kernel.bf16_gemm_triton(x, w), gemv.gemv(x, w))
    assert torch.equal(fp8_kernel.gemm_partials(x, w), gemv.gemv(x, w, gemv.PARTIALS))
    assert torch.equal(gemm_epilogues.gate_up_silu_mul_triton(x, w), gemv.gemv(x, w, gemv.SILU_MUL))
    calls: list[int] = []
    original = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(1) or original(*a))
    fp8_kernel.bf16_gemm_triton(x, w, fp8_kernel.Fp8GemmConfig(32, 64, 1, 4, 2))
    fp8_kernel.bf16_gemm_triton(torch.cat([x, x]), w)
    with gemv.suspended():
        fp8_kernel.bf16_gemm_triton(x, w)
        assert not gemv.applies(1, 960, 576, 2)
    assert not calls and gemv.applies(1, 960, 576, 2)
    monkeypatch.setattr(gemv, "ENABLED", False)  # KILN_GEMV=0
    fp8_kernel.bf16_gemm_triton(x, w)
    assert not calls and not gemv.applies(1, 960, 576, 2)


@pytest.mark.parametrize("mode", [gemv.OUT, gemv.SILU_MUL, gemv.PARTIALS])
def test_after_norm_finishes_the_row_the_projection_before_left(mode: int) -> None:
    """gemv_after_norm (the rmsnorm_gemm pass) from the partials of a split and of a whole-K projection: h exactly
    the add + RMSNorm row kernel's; the normalised row it writes (a MoE layer's experts read it) and the projection
    of it (a router's fp32 sums: PARTIALS) within a rounding of the two kernels' (the sum of squares runs in another
    order)."""
    from kiln.models.gemm_epilogues import gemm_add_rms_norm_triton

    m, n, k = 3, 100, 192
    x, w = operands(m, n, k, 21)
    _, w_next = operands(1, 2 * 40, n, 22)
    g = torch.Generator().manual_seed(23)
    residual = torch.randn(m, n, generator=g).to(DTYPE).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(n, generator=g)).to(DTYPE).to(DEVICE)
    for config in (fp8_kernel.Fp8GemmConfig(32, 64, 2, 4, 2), fp8_kernel.Fp8GemmConfig(32, 64, 1, 4, 2)):
        normed, summed = gemm_add_rms_norm_triton(x, w, residual, norm_weight, 1e-5, config)
        partials = fp8_kernel.gemm_partials(x, w, config=config)
        out, h, row = gemv.gemv_after_norm(partials, residual, norm_weight, 1e-5, w_next, mode)
        assert torch.equal(h, summed)
        torch.testing.assert_close(row.double(), normed.double(), **TOLERANCE)
        torch.testing.assert_close(out.double(), gemv.gemv(normed, w_next, mode).double(), **TOLERANCE)
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_after_norm(partials, residual[:, :-1], norm_weight, 1e-5, w_next)


def test_qkv_rope_on_a_shape_the_kernel_takes_rotates_its_sums() -> None:
    """qkv_rope_triton without a config on a small weight at one token: the plain projection's values, then the
    rotation, so the pass changes nothing the unfused graph computes (compared in the MMA kernel's test's
    arithmetic). Three tensors of their own: kiln::qkv_rope's outputs may not alias (torch's custom-op check
    refused q and k as views of one rotated tensor, which `.contiguous()` leaves them at one token)."""
    from tests.models.test_gemm_epilogues import qkv_rope_reference, rope_cache

    m, heads, kv_heads, head_dim, k = 1, 4, 2, 64, 96
    x, w = operands(m, (heads + 2 * kv_heads) * head_dim, k, 5)
    positions = torch.tensor([31], device=DEVICE)
    cache = rope_cache(64, head_dim)
    got = gemm_epilogues.qkv_rope_triton(x, w, positions, cache, heads, kv_heads)
    for out, want in zip(got, qkv_rope_reference(x, w, positions, cache, heads, kv_heads)):
        assert out.dtype == DTYPE and out.shape == want.shape and out.is_contiguous()
        torch.testing.assert_close(out.double(), want.double(), **TOLERANCE)
    _, _, v = gemv.gemv(x, w).view(m, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    assert torch.equal(got[2], v)
    assert len({out.untyped_storage().data_ptr() for out in got}) == 3


def test_the_router_form_compiles_for_hopper() -> None:
    """Ahead-of-time compile for sm90 (no GPU needed) of the form the rmsnorm_gemm pass gives a MoE router (four
    split partials finished into the row, fp32 sums out): a PDL kernel whose weight tile (4 rows of 2048, 16 KB: 8
    16-byte vectors a thread) and norm weight (2048 bf16: 2 vectors) are loaded before the wait, or the kernel would
    not hide their latency, and that loads nothing once the row's reduction has begun."""
    from tests.models.test_fp8_kernel import sm90_ptx

    ptx = sm90_ptx("gemv_route")
    assert ptx["gdc_wait"] and ptx["launch_pdl"], ptx
    assert ptx["ld_v4_before_wait"] == 10 and ptx["ld_v4"] > 10, ptx
    assert ptx["ld_after_barrier"] == 0, ptx
