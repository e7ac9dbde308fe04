"""The ops the fp8_weight_only pass rewrites one token's FP8 projections to (kiln/passes/fp8_weight_only.py).

Each takes the 16-bit activation and the e4m3 weight with its per-channel scale. Where the streaming kernel runs
(one token on an sm89+ GPU, kiln/models/gemv_stream.py) it dots the 16-bit token against the weight as it stands:
weight-only FP8, no per-token quantization. Anywhere else (a runner that speculates suspends the kernel, so that
its decode equals its verify; the CPU) each op quantizes the token per token and runs the W8A8 path of the graph
it replaced, with that path's values.
"""

from __future__ import annotations

import torch

from kiln.models import gemv_stream
from kiln.models.quant.fp8 import quantize_per_token
from kiln.models.quant.fp8_gemm import use_triton_kernel
from kiln.models.quant.fp8_kernel import flat_scales


def runs_weight_only(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One 16-bit token against an e4m3 weight where the streaming kernel runs."""
    return x.shape[0] == 1 and x.element_size() > 1 and use_triton_kernel(x) \
        and gemv_stream.applies(1, weight.element_size())


@torch.library.custom_op("kiln::fp8_weight_only_gemm", mutates_args=())
def fp8_weight_only_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] 16-bit, weight [N, K] e4m3 with weight_scale [N] -> x W^T, [M, N] in out_dtype."""
    if runs_weight_only(x, weight):
        return gemv_stream.gemv_stream(x, weight, flat_scales(None, weight_scale), out_dtype)
    q, x_scale = quantize_per_token(x)
    return torch.ops.kiln.fp8_gemm(q, weight, x_scale, weight_scale, out_dtype)


@fp8_weight_only_gemm.register_fake
def _fp8_weight_only_gemm_fake(x, weight, weight_scale, out_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("kiln::fp8_weight_only_gemm_add_rms_norm", mutates_args=())
def fp8_weight_only_gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                      residual: torch.Tensor, norm_weight: torch.Tensor,
                                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T + residual [M, N] -> (rms_norm(h) * norm_weight, h) in the residual's dtype: the streaming kernel's
    sums, then one program a row scales, adds and normalises (kiln/models/gemm_epilogues.py)."""
    from kiln.models.gemm_epilogues import fp8_gemm_add_rms_norm_triton

    if runs_weight_only(x, weight):
        return fp8_gemm_add_rms_norm_triton(x, weight, None, weight_scale, residual, norm_weight, eps)
    q, x_scale = quantize_per_token(x)
    if use_triton_kernel(q):
        return fp8_gemm_add_rms_norm_triton(q, weight, x_scale, weight_scale, residual, norm_weight, eps)
    from kiln.passes.ops import _add_rms_norm

    y = torch.ops.kiln.fp8_gemm(q, weight, x_scale, weight_scale, residual.dtype)
    return _add_rms_norm(y, residual, norm_weight, eps)


@fp8_weight_only_gemm_add_rms_norm.register_fake
def _fp8_weight_only_gemm_add_rms_norm_fake(x, weight, weight_scale, residual, norm_weight, eps):
    out = residual.new_empty((x.shape[0], weight.shape[0]))
    return out, torch.empty_like(out)


@torch.library.custom_op("kiln::fp8_weight_only_gemm_add_rms_norm_quant", mutates_args=())
def fp8_weight_only_gemm_add_rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                            residual: torch.Tensor, norm_weight: torch.Tensor,
                                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As fp8_weight_only_gemm_add_rms_norm, but the normalised row feeds a W8A8 projection: -> (its e4m3 values and
    [M, 1] scale, quantize_per_token(rms_norm(h) * norm_weight), h), quantized by the same row kernel."""
    if runs_weight_only(x, weight):
        from kiln.models.gemm_epilogues import fp8_gemm_add_rms_norm_quant_triton

        return fp8_gemm_add_rms_norm_quant_triton(x, weight, None, weight_scale, residual, norm_weight, eps)
    q, x_scale = quantize_per_token(x)
    return torch.ops.kiln.fp8_gemm_add_rms_norm_quant(q, weight, x_scale, weight_scale, residual, norm_weight, eps)


@fp8_weight_only_gemm_add_rms_norm_quant.register_fake
def _fp8_weight_only_gemm_add_rms_norm_quant_fake(x, weight, weight_scale, residual, norm_weight, eps):
    from kiln.passes.ops import _fp8_gemm_add_rms_norm_quant_fake

    return _fp8_gemm_add_rms_norm_quant_fake(x, weight, None, weight_scale, residual, norm_weight, eps)
