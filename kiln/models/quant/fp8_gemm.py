"""`kiln::fp8_gemm`: the row-wise scaled FP8 GEMM of every FP8 linear on CUDA, dispatched at run time.

out = (xq @ wq^T) * x_scale * w_scale, xq [M, K] / wq [N, K] in e4m3, x_scale [M, 1], w_scale [N] fp32.
Small M (decode, M <= TRITON_MAX_M) runs kiln's Triton kernel (kiln/models/quant/fp8_kernel.py), which
streams the weight with enough programs to fill the GPU; larger M runs `torch._scaled_mm`, whose
cuBLAS tiles win once the GEMM has enough rows to be compute bound.

Why a custom op: M is a dynamic dimension of the compiled pieces, so the choice cannot be made while
tracing. The op is opaque to Dynamo (the fake below gives its shape) and Inductor calls it as an extern
kernel; its body picks the kernel on the real M every call, and CUDA graphs capture whichever ran for
their batch size. fp8_linear only routes CUDA tensors here: CPU graphs keep tracing `_scaled_mm` itself.
"""

from __future__ import annotations

import functools
import os

import torch

# Largest M (tokens) that runs the Triton kernel; above it cuBLAS. KILN_FP8_TRITON_MAX_M overrides it
# (0 turns the kernel off, for comparisons); tests set the attribute.
TRITON_MAX_M = int(os.environ.get("KILN_FP8_TRITON_MAX_M", "64"))


def _cpu_takes_rowwise_scales() -> bool:
    """torch 2.13's CPU _scaled_mm takes row-wise scales; 2.11's takes per-tensor scales only."""
    # two rows and columns: [1, 1] scales would pass as per-tensor ones (the H200's torch 2.11 took them)
    two = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(two, two.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


CPU_ROWWISE = _cpu_takes_rowwise_scales()  # probed once at import: a constant to the traced code


def scaled_mm(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The library path: torch._scaled_mm with row-wise scales (on a CPU torch without them, the same e4m3
    products summed in fp32, then scaled)."""
    if q.device.type == "cpu" and not CPU_ROWWISE:
        return ((q.float() @ weight.float().t()) * x_scale.float() * weight_scale.float().reshape(1, -1)).to(out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1), out_dtype=out_dtype)


@functools.lru_cache(maxsize=16)
def _triton_fp8_capable(device_index: int) -> bool:
    """An sm89+ GPU (FP8 MMAs) with Triton importable: asked once per device, not on every GEMM."""
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton_kernel(q: torch.Tensor) -> bool:
    """Decode-sized M on an sm89+ GPU with Triton importable."""
    if q.device.type != "cuda" or q.shape[0] > TRITON_MAX_M:
        return False
    return _triton_fp8_capable(q.device.index if q.device.index is not None else torch.cuda.current_device())


@torch.library.custom_op("kiln::fp8_gemm", mutates_args=())
def fp8_gemm(q: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    if use_triton_kernel(q):
        from kiln.models.quant.fp8_kernel import fp8_gemm_triton

        return fp8_gemm_triton(q, weight, x_scale, weight_scale, out_dtype)
    return scaled_mm(q, weight, x_scale, weight_scale, out_dtype)


@fp8_gemm.register_fake
def _fp8_gemm_fake(q, weight, x_scale, weight_scale, out_dtype):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)
