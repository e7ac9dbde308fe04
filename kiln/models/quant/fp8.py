"""FP8 (float8_e4m3fn) linear layers: quantization helpers and the one GEMM every quantized projection runs.

Weights are stored as e4m3 with one fp32 scale per output channel (a per-tensor checkpoint scale is
broadcast to every channel at load, which is exact and lets one GEMM serve both). Activations are
quantized per token at run time ("dynamic"), or with the checkpoint's static per-tensor `input_scale`.

The activation quantization is plain torch on purpose: amax -> scale -> divide -> cast are element-wise
and reduction ops that Inductor fuses into the kernel that produced the activation (the RMSNorm, the
SiLU-mul), so no separate quantization kernel or fusion pass is needed for that. The GEMM is
`torch._scaled_mm` with row-wise scales on CPU (an aten op that Dynamo traces and Inductor keeps as an
extern kernel) and, on CUDA, the `kiln::fp8_gemm` custom op (fp8_gemm.py), which runs kiln's Triton kernel
for decode-sized M and `_scaled_mm` otherwise; CUDA graphs capture either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.models.quant.fp8_gemm import scaled_mm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale: keeps an all-zero row (padding, a zero embedding) from dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are quantized. `source` is where the FP8 weights come from: "online"
    (quantized from a bf16/fp32 checkpoint at load) or the checkpoint's quant_method; `static_input`
    says the checkpoint carries a per-tensor `input_scale` for every projection."""

    source: str = "online"
    static_input: bool = False


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] full-precision weight -> ([N, K] e4m3, [N] fp32 scale), one scale per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] activations -> ([T, K] e4m3, [T, 1] fp32 scale): one scale per token (row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] activations with a fixed per-tensor scale (shape [1]) -> (e4m3, [T, 1] fp32 scale)."""
    q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype, W in e4m3 with a per-output-channel scale; x [..., K]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q, x_scale = quantize_per_token(x2) if input_scale is None else quantize_static(x2, input_scale)
    # row-wise scaled GEMMs on CUDA produce bf16 only; the CPU kernel also takes fp32 (the CI models)
    if x.is_cuda:  # kiln::fp8_gemm picks the Triton kernel (small M) or _scaled_mm at run time
        y = torch.ops.kiln.fp8_gemm(q, weight, x_scale, weight_scale, torch.bfloat16).to(x.dtype)
    else:
        y = scaled_mm(q, weight, x_scale, weight_scale, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full-precision weight an e4m3 one stands for (tests, reference paths)."""
    return (weight.float() * weight_scale.float().reshape(-1, 1)).to(dtype)
