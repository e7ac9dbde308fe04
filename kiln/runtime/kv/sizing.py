"""How many KV blocks fit: a byte budget on CPU; on GPU, what is left of the memory budget after the
weights and the activation peak of a profiling forward at the full token budget."""

from __future__ import annotations

import gc
import logging

import torch

from kiln.attention.base import AttentionLayout
from kiln.config import CacheConfig
from kiln.models.base import ModelSpec

logger = logging.getLogger("kiln")

CPU_DEFAULT_KV_BYTES = 512 * 1024 * 1024


def bytes_per_block(spec: ModelSpec, dtype: torch.dtype, block_size: int, num_kv_heads: int) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * block_size * num_kv_heads * spec.head_dim * element


def kv_cache_num_blocks(cache: CacheConfig, spec: ModelSpec, device: torch.device, model: torch.nn.Module,
                        max_num_batched_tokens: int, layout: AttentionLayout, max_model_len: int,
                        run_attention: bool = False) -> int:
    """`layout`: this rank's share of the attention heads, its KV dtype and block size; `max_model_len` bounds
    the positions of the profiling forward; `run_attention`: the serving backend's prefill materializes its
    scores, so the profiling forward runs attention (profile.py)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    # the cache's own element type: an fp8 cache fits twice the blocks of a bf16 one in the same bytes
    per_block = bytes_per_block(spec, layout.cache_dtype, cache.block_size, layout.num_kv_heads)
    if cache.kv_cache_bytes is not None:
        budget = cache.kv_cache_bytes
    elif device.type == "cpu":
        budget = CPU_DEFAULT_KV_BYTES
    else:
        budget = _gpu_budget(cache, device, model, max_num_batched_tokens, layout, max_model_len, run_attention)
    num_blocks = budget // per_block + 1  # + the null block
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block ({per_block} bytes each); "
                         "raise kv_cache_bytes / gpu_memory_utilization")
    return int(num_blocks)


def return_cached_memory(device: torch.device) -> None:
    """Give torch's cached GPU blocks back to the driver before this worker allocates anything. A runtime dropped
    earlier in the process leaves its KV cache there as one cached block; the new weights would be cut out of it,
    and a block in part in use cannot be given back, so the KV sizing would count it all as in use (a second
    runtime at gpu_memory_utilization=0.3 on an H100 got a budget of 0 bytes). The KV sizing calls it again."""
    gc.collect()  # a dropped runtime may still sit in a reference cycle
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _gpu_budget(cache: CacheConfig, device: torch.device, model: torch.nn.Module, num_tokens: int,
                layout: AttentionLayout, max_model_len: int, run_attention: bool) -> int:
    """Budget = total * utilisation - (what is in use now + the activation peak of one forward)."""
    from kiln.runtime.kv.peak_cache import activation_peak

    return_cached_memory(device)  # what a dropped runtime left in torch's cache is not in use
    free, total = torch.cuda.mem_get_info(device)
    peak, cached = activation_peak(model, device, num_tokens, layout, max_model_len, run_attention)
    used = total - free
    budget = int(total * cache.gpu_memory_utilization) - used - peak
    logger.info("GPU memory: total %.1f GiB, in use %.1f GiB, activation peak %.2f GiB (%s) -> KV budget %.1f GiB",
                total / 2**30, used / 2**30, peak / 2**30, "cached" if cached else "profiled", budget / 2**30)
    return max(budget, 0)
