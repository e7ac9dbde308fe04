"""The on-disk compile artifact cache (docs/cache.md): key (key.py), store (store.py), Inductor's torch_key and
Triton's triton_key and Inductor's CPU ISA checks remembered (torch_key.py, triton_key.py, vec_isa.py),
unchanged Inductor cache files left alone (inductor_writes.py).

The runtime asks `store_factory` for a factory; the compiler calls it once the pass hook exists (its
uuid is a key factor) and hands the store to Inductor's compile step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kiln.cache.inductor_writes import skip_unchanged_writes
from kiln.cache.key import cache_key, key_factors
from kiln.cache.store import CompileCacheStore, cache_disabled, cache_root, compile_root
from kiln.cache.torch_key import prime_torch_key
from kiln.cache.triton_key import prime_triton_key
from kiln.cache.vec_isa import prime_vec_isa

__all__ = ["CompileCacheStore", "cache_disabled", "cache_key", "cache_root", "compile_root", "key_factors",
           "store_factory"]

StoreFactory = Callable[[Any, Mapping[str, Any]], CompileCacheStore]


def store_factory(*, spec: Any, dtype: torch.dtype, compilation: Any, max_num_tokens: int,
                  device: torch.device, attention_backend: str, rank: int = 0,
                  tp_size: int = 1) -> StoreFactory | None:
    """None when the cache is off (KILN_DISABLE_COMPILE_CACHE=1) or nothing is compiled (-O0)."""
    if cache_disabled() or compilation.level < 1:
        return None

    def make(pass_hook: Any, inductor_patches: Mapping[str, Any]) -> CompileCacheStore:
        prime_torch_key()  # before any artifact is loaded or compiled: both need Inductor's torch_key
        skip_unchanged_writes()  # a warm start's loads rewrite Inductor's cache files with the same bytes
        if device.type == "cuda":  # and on a GPU Triton's triton_key (a CPU start may not import Triton at all)
            prime_triton_key()
        else:  # on a CPU the vector-ISA checks before the first C++ kernel
            prime_vec_isa()
        uuid = pass_hook.uuid() if pass_hook is not None else None
        factors = key_factors(spec=spec, dtype=dtype, compilation=compilation, max_num_tokens=max_num_tokens,
                              device=device, attention_backend=attention_backend, pass_uuid=uuid,
                              inductor_patches=inductor_patches, tp_size=tp_size)
        return CompileCacheStore(compile_root() / cache_key(factors), rank, factors)

    return make

