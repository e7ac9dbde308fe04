"""The GEMM that normalises its operand as it loads it (kiln/models/gemm_norm_prologue.py) against the two kernels it
stands for (kiln::gemm_add_rms_norm's, then the next projection's), and kiln::gemm_add_rms_norm_gemm's dispatch.
Without a GPU the kernels run under Triton's CPU interpreter in fp16 (tests/models/test_gemm_epilogues.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.conftest import define_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# the norm's rounding moves (the module's docstring): an operand ulp apart, summed over K products, and the outputs
# rounded apart: a 16-bit ulp or two of the output's scale (bf16's ulp is 8x fp16's)
ULPS = 2 ** -6 if DTYPE == torch.bfloat16 else 2 ** -9


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    want = want.double()
    torch.testing.assert_close(got.double(), want, rtol=ULPS, atol=ULPS * want.abs().max().item())


def assert_two_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """The fp32 sums' order, the output's rounding and, in the SiLU-mul, gate's and up's roundings (either may land
    on the other side of a tie): two ulps of the 16-bit output."""
    ulp = 2 ** -7 if DTYPE == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(got.double(), want, rtol=2 * ulp, atol=ulp * 2 ** -4)

if DEVICE == "cpu":
    define_interpreted("kiln.models.quant.fp8_kernel", "kiln.models.gemm_epilogues", "kiln.models.gemm_norm_prologue")

import kiln.passes.ops  # noqa: E402, F401 - registers the ops
from kiln.models.gemm_epilogues import gemm_add_rms_norm_triton  # noqa: E402
from kiln.models.gemm_norm_prologue import rmsnorm_gemm_triton, whole_rows_config  # noqa: E402
from kiln.models.quant.fp8_kernel import Fp8GemmConfig, gemm_partials  # noqa: E402
from kiln.passes.ops import rms_norm_ref  # noqa: E402
from tests.models.test_fp8_kernel import sm90_ptx  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def layer_slice(m: int, k_in: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [m, k_in] into a projection W [k, k_in] joining a residual [m, k], the norm's weight [k], the next W [n, k]."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DTYPE).to(DEVICE)  # noqa: E731
    return (make(m, k_in), make(k, k_in, scale=0.1), make(m, k),
            (1 + 0.1 * torch.randn(k, generator=g)).to(DTYPE).to(DEVICE), make(n, k, scale=0.1))


@pytest.mark.parametrize("m,k_in,k,n,split,silu_mul", [
    (1, 256, 200, 96, 4, False),  # four partials; K off the tile
    (3, 128, 128, 80, 1, True),  # one whole-K partial; the SiLU-mul's 40 columns off its 32-column tile
    (17, 128, 96, 64, 2, False),  # two token tiles
])
def test_the_normalising_gemm_matches_the_row_kernel_then_the_gemm(m: int, k_in: int, k: int, n: int, split: int,
                                                                    silu_mul: bool) -> None:
    """h exactly as kiln::gemm_add_rms_norm's row kernel writes it from the same partials; the output as the next
    projection of the model's RMSNorm of h, within the moved rounding, and what the kernel's own arithmetic gives in
    float64 (h * w rounded, the sums scaled by 1 / rms), to two output ulps."""
    x, w, residual, norm_weight, w_next = layer_slice(m, k_in, k, n, seed=m + k)
    config = Fp8GemmConfig(64, 64, split, 4, 2)
    partials = gemm_partials(x, w, None, config)
    assert partials.shape[0] == split
    out, h = rmsnorm_gemm_triton(partials, residual, norm_weight, 1e-5, w_next, silu_mul)
    normed, want_h = gemm_add_rms_norm_triton(x, w, residual, norm_weight, 1e-5, config)
    assert torch.equal(h, want_h)
    hd = want_h.double()
    rstd = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5)
    for operand, scale, near in ((rms_norm_ref(want_h, norm_weight, 1e-5), 1.0, assert_near),
                                 ((want_h.float() * norm_weight.float()).to(DTYPE), rstd, assert_two_ulps)):
        y = operand.double() @ w_next.double().t() * scale
        if silu_mul:
            gate, up = y.to(DTYPE).double().chunk(2, dim=-1)
            y = F.silu(gate) * up
        assert out.dtype == DTYPE and out.shape == (m, n // 2 if silu_mul else n)
        near(out, y)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_gemm_triton(partials, residual[:, :-1], norm_weight, 1e-5, w_next, silu_mul)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_op_equals_the_two_ops_it_stands_for(m: int, silu_mul: bool) -> None:
    """kiln::gemm_add_rms_norm_gemm: on the CPU (and past 16 tokens) the two ops themselves, exactly; on CUDA at
    decode sizes the normalising kernel, within its rounding. Its fake (what Dynamo traces) agrees with it."""
    x, w, residual, norm_weight, w_next = layer_slice(m, 64, 96, 64, seed=m)
    out, h = torch.ops.kiln.gemm_add_rms_norm_gemm(x, w, residual, norm_weight, 1e-6, w_next, silu_mul)
    normed, want_h = torch.ops.kiln.gemm_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    want = (torch.ops.kiln.gate_up_silu_mul if silu_mul else torch.ops.kiln.dense_gemm)(normed, w_next)
    assert torch.equal(h, want_h)
    if DEVICE == "cuda" and m <= 16:
        assert_near(out, want)
    else:
        assert torch.equal(out, want)
    torch.library.opcheck(torch.ops.kiln.gemm_add_rms_norm_gemm.default,
                          (x, w, residual, norm_weight, 1e-6, w_next, silu_mul), test_utils=("test_faketensor",))


def test_only_configs_without_split_k_normalise_in_the_gemm() -> None:
    """A split of K sees part of the row, so those shapes keep the two kernels: SmolLM2-135M's qkv and gate_up take
    whole rows; Llama-3-8B's qkv (6144 x 4096) splits K in two at decode sizes."""
    weight = lambda n, k: torch.empty(n, k, dtype=DTYPE, device="meta")  # noqa: E731
    assert whole_rows_config(1, weight(960, 576)) is not None and whole_rows_config(16, weight(3072, 576)) is not None
    assert whole_rows_config(1, weight(6144, 4096)) is None


@pytest.mark.parametrize("kernel", ["rmsnorm_gemm", "rmsnorm_gate_up"])
def test_the_normalising_gemm_compiles_for_hopper_to_pipelined_wgmma(kernel: str) -> None:
    """Ahead-of-time compile for sm90: the weight still streams through multi-stage async copies into bf16 wgmma
    with the operand computed in registers, and the launch takes part in PDL."""
    ptx = sm90_ptx(kernel)
    assert ptx["wgmma"] and ptx["bf16"] and ptx["cp_async"], ptx
    assert ptx["shared"] >= 3 * 64 * 128 * 2, ptx  # several stages of W tiles in flight
    assert ptx["gdc_wait"] and ptx["gdc_launch"] and ptx["launch_pdl"], ptx
