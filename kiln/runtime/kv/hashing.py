"""Chained block hashes: a block's hash covers its parent's hash, its token ids and extra keys.

Chaining means equal hashes imply equal prefixes, so one dictionary lookup per block finds the
longest shared prefix. The cache salt enters the first block, so it namespaces the whole chain.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Hashable, Sequence

BlockHashFn = Callable[[Hashable | None, Sequence[int], tuple], Hashable]


def sha256_block_hash(parent: Hashable | None, tokens: Sequence[int], extra: tuple) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra), protocol=5)).digest()


def make_fast_block_hash(seed: int | None = None) -> BlockHashFn:
    """Python's tuple hash, salted per process (random unless a seed is given): fast, not collision-proof."""
    salt = int.from_bytes(os.urandom(8), "little") if seed is None else seed

    def fast_block_hash(parent: Hashable | None, tokens: Sequence[int], extra: tuple) -> int:
        return hash((salt, parent, tuple(tokens), extra))

    return fast_block_hash


def block_hash_fn(name: str, seed: int | None = None) -> BlockHashFn:
    if name == "sha256":
        return sha256_block_hash
    if name == "fast":
        return make_fast_block_hash(seed)
    raise ValueError(f"unknown prefix hash {name!r}; choose sha256 or fast")


def extend_block_hashes(hashes: list[Hashable], token_ids: Sequence[int], block_size: int,
                        hash_fn: BlockHashFn, cache_salt: str | None) -> None:
    """Append hashes for every newly full block of token_ids (hashes holds those already computed)."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
