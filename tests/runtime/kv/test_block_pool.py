"""Block pool and hashing: ref counts, null block, LRU eviction of cached blocks, chained hashes."""

from __future__ import annotations

import random

import pytest

from kiln.runtime.kv.block_pool import BlockPool
from kiln.runtime.kv.hashing import block_hash_fn, extend_block_hashes


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert blocks is not None and 0 not in [b.block_id for b in blocks]
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(blocks)
    assert pool.num_free == pool.num_usable == 4


def test_allocation_is_all_or_nothing_and_double_free_is_caught() -> None:
    pool = BlockPool(4)
    assert pool.allocate(4) is None and pool.num_free == 3
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_uncached_free_blocks_are_reused_before_cached_ones_then_lru() -> None:
    pool = BlockPool(6)
    a, b, c, d, e = pool.allocate(5)
    for block, h in ((a, "ha"), (b, "hb"), (c, "hc")):
        pool.cache(block, h)
    pool.free([b])  # cached, freed first -> least recently used
    pool.free([a])
    pool.free([d])  # uncached -> handed out first
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first is d and pool.evictions == 0
    second, third = pool.allocate(2)
    assert (second, third) == (b, a) and pool.evictions == 2
    assert pool.lookup("hb") is None and pool.lookup("ha") is None and pool.lookup("hc") is c


def test_cache_hit_revives_a_free_block() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, "h")
    pool.free([a])
    assert pool.num_free == 2
    hit = pool.lookup("h")
    pool.share([hit])
    assert hit is a and a.ref_cnt == 1 and pool.num_free == 1


@pytest.mark.parametrize("name", ["sha256", "fast"])
def test_chained_hashes_cover_the_prefix_and_the_salt(name: str) -> None:
    fn = block_hash_fn(name, seed=1)
    tokens = list(range(40))
    h1: list = []
    extend_block_hashes(h1, tokens, 16, fn, None)
    assert len(h1) == 2  # the partial third block is never hashed
    h2: list = []
    extend_block_hashes(h2, [99] + tokens[1:], 16, fn, None)
    assert h2[0] != h1[0] and h2[1] != h1[1]  # a change in block 0 changes every later hash
    salted: list = []
    extend_block_hashes(salted, tokens, 16, fn, "tenant-a")
    assert salted[0] != h1[0] and salted[1] != h1[1]
    again: list = []
    extend_block_hashes(again, tokens, 16, fn, None)
    assert again == h1


class EagerPool:
    """The reference order: every block queued from the start (uncached freed to the front, cached to the back)."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hashed: dict[int, str] = {}

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        for i in out:
            self.hashed.pop(i, None)
            self.ref[i] = 1
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free_ids = self.free_ids + [i] if i in self.hashed else [i] + self.free_ids


def test_blocks_are_made_on_first_use_in_the_eager_order() -> None:
    # tens of millions of blocks (a small model on a large GPU) cost nothing until they are handed out
    huge = BlockPool(5_000_000)
    assert len(huge.blocks) == 1 and huge.num_free == 4_999_999
    pool, reference, rng = BlockPool(40), EagerPool(40), random.Random(0)
    held: list[list] = []
    for step in range(400):
        if held and rng.random() < 0.45:
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:  # some finished requests leave their blocks in the prefix cache
                for block in blocks:
                    pool.cache(block, f"h{step}-{block.block_id}")
                    reference.hashed[block.block_id] = "cached"
            pool.free(blocks[::-1])
            reference.free([b.block_id for b in blocks[::-1]])
        else:
            n = rng.randint(1, 6)
            blocks, expected = pool.allocate(n), reference.allocate(n)
            assert (None if blocks is None else [b.block_id for b in blocks]) == expected
            if blocks is not None:
                held.append(blocks)
        assert pool.num_free == len(reference.free_ids)
