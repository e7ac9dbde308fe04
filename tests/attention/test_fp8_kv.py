"""An fp8 (e4m3) KV cache in the attention backends: the torch backend against an fp32 reference that reads
the same dequantized values, and the Triton kernels (under TRITON_INTERPRET=1 on a CPU) against the torch
backend, cache bytes included.

Triton's interpreter converts float -> e4m3 wrongly (measured with triton 3.9: 7.9 -> 4.0, the rounding carry
into the exponent is lost; ties round away from zero; subnormals flush to 0), so on a CPU the Triton kernels are
fed keys/values that e4m3 holds exactly (normal numbers times the scale), which tests every read, the scales
and the store, but not the rounding of the write. tests/gpu/test_attention_backends.py tests that on a GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.attention.base import AttentionLayout
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.models.kv_quant import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from tests.attention.paged_batch import PagedBatch, make_batch, reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K_SCALE, V_SCALE = 0.5, 2.0  # not 1.0, so a scale applied twice, or not at all, shows


def fp8_batch(q_lens: list[int], contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, seed: int) -> PagedBatch:
    """A random batch whose cache is e4m3 (NaN poison kept: e4m3fn has a NaN), keys x3 so some clamp."""
    batch = make_batch(q_lens, contexts, num_heads, num_kv_heads, head_dim, dtype, DEVICE, seed=seed)
    cache = batch.kv_cache.float()
    cache[:, 0] *= 3.0
    stored = torch.empty(cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    stored[:, 0] = quantize_kv(cache[:, 0], K_SCALE, FP8_KV_DTYPE)
    stored[:, 1] = quantize_kv(cache[:, 1], V_SCALE, FP8_KV_DTYPE)
    layout = AttentionLayout(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, batch.layout.block_size, dtype,
                             FP8_KV_DTYPE)
    return PagedBatch(layout, batch.q, batch.k * 3.0, batch.v, stored, batch.common)


def exactly_representable(batch: PagedBatch) -> PagedBatch:
    """The batch with the new keys/values replaced by values e4m3 stores without rounding (no subnormals)."""
    def snap(x: torch.Tensor, scale: float) -> torch.Tensor:
        units = quantize_kv(x, scale, FP8_KV_DTYPE).float()
        units = torch.where(units.abs() < 2.0 ** -6, 0.0, units)  # e4m3's smallest normal is 2^-6
        return (units * scale).to(x.dtype)

    return PagedBatch(batch.layout, batch.q, snap(batch.k, K_SCALE), snap(batch.v, V_SCALE), batch.kv_cache,
                      batch.common)


def run_fp8(backend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.kv_cache.clone()
    out = torch.full_like(batch.q, float("nan"))
    backend.forward(batch.q, batch.k, batch.v, out, cache, backend.build_metadata(batch.common), K_SCALE, V_SCALE)
    return out[: batch.num_tokens], cache


def dequantized(batch: PagedBatch) -> PagedBatch:
    """The same batch in fp32 with every K/V value replaced by what the fp8 cache reads back: attention over
    it is what an exact fp8 backend computes."""
    def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize_kv(quantize_kv(x, scale, FP8_KV_DTYPE), scale, torch.float32)

    cache = torch.empty(batch.kv_cache.shape, dtype=torch.float32, device=DEVICE)
    cache[:, 0] = dequantize_kv(batch.kv_cache[:, 0], K_SCALE, torch.float32)
    cache[:, 1] = dequantize_kv(batch.kv_cache[:, 1], V_SCALE, torch.float32)
    layout = AttentionLayout(batch.layout.num_heads, batch.layout.num_kv_heads, batch.layout.head_dim,
                             batch.layout.scale, batch.layout.block_size, torch.float32)
    return PagedBatch(layout, batch.q.float(), round_trip(batch.k, K_SCALE), round_trip(batch.v, V_SCALE), cache,
                      batch.common)


CASES = [([37, 1, 64, 5, 1], [0, 200, 130, 17, 333]),  # prefill, chunk after a prefix hit, decodes
         ([1, 1, 1], [0, 95, 300]),  # uniform decode (Triton: the fused split-KV kernel)
         ([1, 1, 1, 30, 1], [40, 0, 90, 0, 10]),  # leading decodes (Triton below: split off to the decode kernel)
         ([5, 5], [60, 7])]  # a speculative verify batch (Triton: the decode kernel, token by token)


@pytest.mark.parametrize("q_lens,contexts", CASES)
def test_torch_backend_reads_what_it_stored(q_lens: list[int], contexts: list[int]) -> None:
    batch = fp8_batch(q_lens, contexts, 8, 2, 64, torch.float32, seed=len(q_lens))
    out, cache = run_fp8(TorchAttentionBackend(batch.layout, torch.device(DEVICE)), batch)
    ref_out, ref_cache = reference(dequantized(batch))
    assert rel_err(out, ref_out) <= 1e-5
    # the new keys/values are stored as clamp(x / scale) in e4m3: exactly the reference's values over scale
    stored = torch.stack([dequantize_kv(cache[1:, 0], K_SCALE, torch.float32),
                          dequantize_kv(cache[1:, 1], V_SCALE, torch.float32)], 1)
    assert torch.equal(stored.nan_to_num(), ref_cache[1:].nan_to_num())
    # and fp8 is an approximation of the unquantized attention, not something else
    exact = reference(PagedBatch(batch.layout, batch.q, batch.k, batch.v, dequantized(batch).kv_cache, batch.common))
    assert 1e-4 < rel_err(out, exact[0]) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_lens,contexts", CASES)
def test_triton_kernels_match_torch_backend(q_lens: list[int], contexts: list[int], dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from kiln.attention.triton_backend import TritonAttentionBackend

    batch = fp8_batch(q_lens, contexts, 8, 2, 64, dtype, seed=3 + len(q_lens))
    if DEVICE == "cpu":
        batch = exactly_representable(batch)
    triton_backend = TritonAttentionBackend(batch.layout, torch.device(DEVICE))
    triton_backend.mixed_decode_min = 2  # a mixed batch's leading decodes go to the decode kernel from 2
    out, cache = run_fp8(triton_backend, batch)
    ref_out, ref_cache = run_fp8(TorchAttentionBackend(batch.layout, torch.device(DEVICE)), batch)
    assert rel_err(out, ref_out) <= (1e-4 if dtype == torch.float32 else 1e-2)
    # the same bytes in every slot but the null block (padding writes there in any order)
    assert torch.equal(cache[1:].view(torch.uint8), ref_cache[1:].view(torch.uint8))
