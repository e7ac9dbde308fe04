"""The Triton kernels behind the fused ops agree with the reference arithmetic.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when
the kernels are defined); on a GPU machine the same checks run natively (tests/gpu runs this file too).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]


def check_kernels(device: str) -> None:
    from kiln.models.attention_op import write_kv
    from kiln.passes import kernels as K
    from kiln.passes import ops as O

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.13)):  # bf16: one ulp at |x| ~ 8
        def rand(*shape: int, d: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(d).to(device)

        num_tokens, hq, hkv, dim = 5, 4, 2, 24  # half = 12: not a power of two, exercises the masks
        q, k, v = rand(num_tokens, (hq + 2 * hkv) * dim).split([hq * dim, hkv * dim, hkv * dim], -1)
        q, k, v = q.view(num_tokens, hq, dim), k.view(num_tokens, hkv, dim), v.view(num_tokens, hkv, dim)
        positions, cos_sin = torch.tensor([3, 0, 7, 2, 9], device=device), rand(16, dim, d=torch.float32)
        slots = torch.tensor([5, 1, 14, 0, 9], device=device)
        for qw, kw in ((None, None), (rand(dim), rand(dim))):
            ref_q, ref_k = O.norm_rope_ref(q, k, positions, cos_sin, qw, kw, 1e-6)
            got_q, got_k = K.norm_rope_triton(q, k, positions, cos_sin, qw, kw, 1e-6)
            torch.testing.assert_close(got_q.float(), ref_q.float(), atol=tol, rtol=0)
            torch.testing.assert_close(got_k.float(), ref_k.float(), atol=tol, rtol=0)
            v_out = torch.full_like(v, float("nan"), memory_format=torch.contiguous_format)
            got_k = K.norm_rope_triton(q, k, positions, cos_sin, qw, kw, 1e-6, v=v, v_out=v_out)[1]
            torch.testing.assert_close(got_k.float(), ref_k.float(), atol=tol, rtol=0)
            assert torch.equal(v_out, v)  # the strided v, copied whole in the same launch
            cache, ref_cache = (torch.zeros(4, 2, 4, hkv, dim, dtype=dtype, device=device) for _ in range(2))
            got_q = K.norm_rope_triton(q, k, positions, cos_sin, qw, kw, 1e-6, v=v, kv_cache=cache,
                                       slot_mapping=slots)[0]
            write_kv(ref_k, v, ref_cache, slots)
            torch.testing.assert_close(got_q.float(), ref_q.float(), atol=tol, rtol=0)
            torch.testing.assert_close(cache.float(), ref_cache.float(), atol=tol, rtol=0)
            if device != "cpu":  # the interpreter's float -> e4m3 cast is wrong (tests/attention/test_fp8_kv)
                check_fp8_cache_write(q, k, v, positions, cos_sin, qw, kw, slots, ref_cache)
        x, r, w = rand(6, 40), rand(6, 40), rand(40)
        normed, summed = K.add_rms_norm_triton(x, r, w, 1e-5)
        torch.testing.assert_close(summed.float(), (x + r).float(), atol=tol, rtol=0)
        torch.testing.assert_close(normed.float(), O.rms_norm_ref(x + r, w, 1e-5).float(), atol=tol, rtol=0)
        gate_up = rand(3, 2 * 1500)
        gate, up = gate_up.chunk(2, -1)
        torch.testing.assert_close(K.silu_and_mul_triton(gate_up).float(),
                                   (torch.nn.functional.silu(gate) * up).float(), atol=tol, rtol=0)
        inductor = (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)  # fp32 to the product
        torch.testing.assert_close(K.silu_and_mul_triton(gate_up, round_act=False).float(), inductor.float(),
                                   atol=tol, rtol=0)
        q, scale = K.silu_mul_quant_triton(gate_up)
        ref_q, ref_scale = O.silu_mul_quant_ref(gate_up)
        # on a GPU exp's last bits can move the amax by a bf16 ulp; the interpreter's bf16 casts truncate,
        # twice (the SiLU, then the product): up to two ulps
        torch.testing.assert_close(scale, ref_scale, atol=0, rtol=2 ** -7 if device != "cpu" else 2 ** -6)
        if device != "cpu":  # the interpreter's float -> e4m3 cast is wrong (as above)
            q, ref_q = q.float(), ref_q.float()
            assert ((q - ref_q).abs() <= ref_q.abs() * 2 ** -3 + 2 ** -9).all()  # within an e4m3 step


def check_fp8_cache_write(q, k, v, positions, cos_sin, qw, kw, slots, ref_cache) -> None:
    """The fused RoPE + write into an e4m3 cache stores clamp(x / scale) (kiln/models/kv_quant.py): read back
    times the scale, within e4m3's rounding (half an ulp: 2^-4 relative, or the subnormal step) of the
    unquantized write."""
    from kiln.models.kv_quant import FP8_KV_DTYPE
    from kiln.passes import kernels as K

    k_scale, v_scale = 0.25, 2.0
    cache = torch.zeros(ref_cache.shape, dtype=FP8_KV_DTYPE, device=ref_cache.device)
    K.norm_rope_triton(q, k, positions, cos_sin, qw, kw, 1e-6, v=v, kv_cache=cache, slot_mapping=slots,
                       k_scale=k_scale, v_scale=v_scale)
    for which, scale in ((0, k_scale), (1, v_scale)):
        got, ref = cache[:, which].float() * scale, ref_cache[:, which].float()
        torch.testing.assert_close(got, ref, rtol=2.0 ** -4 + 2.0 ** -7, atol=2.0 ** -9 * scale)


def test_kernels_match_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.passes.test_kernels import check_kernels; check_kernels('cpu')"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_reference_on_gpu() -> None:
    check_kernels("cuda")


@pytest.mark.parametrize("kv_fp8", [True, False])
def test_cache_writing_rope_kernel_compiles_for_hopper(kv_fp8: bool) -> None:
    """The interpreter runs Python, not Triton's type rules: a value from before a runtime `if` that changed
    type inside it passed the CPU tests and failed to compile on the H200. Compiling for sm_90 applies them."""
    import triton

    from tests.models.test_fp8_kernel import sm90_ptx

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no CUDA backend here")
    ptx = sm90_ptx("norm_rope", str(int(kv_fp8)))  # the compile's own process, without TRITON_INTERPRET
    # the norm's weights load before the PDL wait (a program needs them only after its head's reduction)
    assert ptx["gdc_wait"] and ptx["launch_pdl"] and ptx["ld_before_wait"] >= 2, ptx


def test_add_norm_kernel_loads_its_weight_before_the_pdl_wait() -> None:
    """Ahead-of-time compile for sm90 (no GPU needed) of the add + RMSNorm row kernel: the norm's weight is loaded
    before the wait (a program needs it only after its row's reduction, where the load would be a DRAM round trip
    of its own), and nothing is loaded once the reduction has begun."""
    from tests.models.test_fp8_kernel import sm90_ptx

    ptx = sm90_ptx("add_norm")
    assert ptx["gdc_wait"] and ptx["launch_pdl"], ptx
    assert ptx["ld_before_wait"] >= 1 and ptx["ld_after_barrier"] == 0, ptx
