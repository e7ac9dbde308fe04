"""FP8 KV cache arithmetic: what a stored value is, and how it is read back.

A cache in float8_e4m3fn holds `clamp(x / scale, -448, 448)` rounded to e4m3 (round to nearest even), one
fp32 scale per layer for keys and one for values; a read is `e4m3 -> compute dtype, * scale`. The clamp is
explicit because torch's float -> e4m3fn cast turns anything beyond +-448 into NaN rather than saturating.
Every backend's kernels follow these two functions (the torch backend calls them; the Triton kernels spell
them out), so their caches hold the same bytes.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in the model dtype -> the value a cache of `cache_dtype` stores (x itself for a non-fp8 cache)."""
    if not is_fp8(cache_dtype):
        return x
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A value read from the cache -> `dtype` (a no-op for a cache already in `dtype`)."""
    if not is_fp8(x.dtype):
        return x
    return x.to(dtype) if scale == 1.0 else x.to(dtype) * scale
