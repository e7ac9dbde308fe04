"""The pool of KV blocks: ref counts, a free queue in eviction order, and the prefix-cache index.

Block 0 is the null block: never allocated, it absorbs writes of padded tokens. A free block that still
holds a cached (hashed) prefix stays findable until it is reused; uncached free blocks are handed out
first, then cached ones in least-recently-freed order (LRU).

Blocks are made on first use: a block never handed out is only a number above `len(self.blocks)`. A small model
on a large GPU has tens of millions of blocks (tiny-llama on the H200: 32.8 million), and an object and a queue
entry for each cost ~1 us and ~250 B apiece before the first request (by log timing, the 38 s of 'other' in that
start-up on the H200). The order in which blocks are handed out is the same as with every block queued from the
start (uncached freed blocks, then the never-used ones in id order, then cached ones, LRU), except after
`reset_prefix_cache`: the blocks it uncaches then come before the never-used ones (either kind is free and empty
of cached data).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(0)]  # every block handed out so far, by id; the rest are made on first use
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently held
        # freed blocks; front = next to hand out: uncached ones go to the front, cached ones to the back
        self._free: OrderedDict[int, Block] = OrderedDict()
        self._cached: dict[Hashable, Block] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks (ref 1), evicting cached ones if needed; None (and no change) if too few free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            block = self._next_free()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def _next_free(self) -> Block:
        """An uncached freed block, else a never-used one, else the least recently freed cached one."""
        front = next(iter(self._free.values()), None)
        if (front is None or front.block_hash is not None) and len(self.blocks) < self.num_blocks:
            self.blocks.append(Block(len(self.blocks)))
            return self.blocks[-1]
        return self._free.popitem(last=False)[1]

    def lookup(self, block_hash: Hashable) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def share(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits (reviving them from the free queue if needed)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each. Pass a request's blocks tail-first so its tail is evicted first."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: Hashable) -> None:
        """Publish a full, computed block under its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
