"""Per-request block lists on top of the pool: prefix lookup, allocation for new tokens, freeing."""

from __future__ import annotations

from kiln.runtime.kv.block_pool import Block, BlockPool
from kiln.runtime.kv.hashing import BlockHashFn, extend_block_hashes
from kiln.runtime.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, hash_fn: BlockHashFn) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ints: what the runner copies each step
        self.num_published: dict[str, int] = {}  # leading blocks of each request already in the cache index
        self.queries = 0  # prefix-cache lookups, in tokens
        self.hits = 0  # tokens found cached

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable * self.block_size

    def block_ids_of(self, req: Request) -> list[int]:
        return self.req_block_ids.get(req.request_id, [])

    def _update_hashes(self, req: Request) -> None:
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, self.hash_fn,
                            req.params.cache_salt)

    def find_prefix(self, req: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks at the start of req, and how many tokens that lets it skip.

        The skip stops one token short of the end so the last token is always computed (it needs logits). A
        request that asks for prompt logprobs skips nothing: every prompt position needs its logits.
        """
        if not self.pool.enable_caching or req.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(req)
        hit: list[Block] = []
        for block_hash in req.block_hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, min(len(hit) * self.block_size, req.num_tokens - 1)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[Block] | None = None) -> bool:
        """Make room for req's next num_new_tokens (after taking prefix blocks); False leaves nothing changed."""
        blocks = self.req_blocks.get(req.request_id, [])
        if not prefix and blocks:  # the common decode step: usually no new block, nothing to publish
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size:
                if total // self.block_size > self.num_published.get(req.request_id, 0):
                    self._cache_full_blocks(req, blocks, total)
                return True
        prefix = prefix or []
        num_computed = req.num_computed_tokens if not prefix else 0
        covered = len(blocks) + len(prefix)
        total = max(num_computed, min(len(prefix) * self.block_size, req.num_tokens - 1)) + num_new_tokens
        needed = -(-total // self.block_size) - covered
        revived = sum(1 for b in prefix if b.ref_cnt == 0)
        if needed > self.pool.num_free - revived:
            return False
        self.pool.share(prefix)
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        new = prefix + (self.pool.allocate(needed) if needed > 0 else [])
        blocks.extend(new)
        self.req_block_ids.setdefault(req.request_id, []).extend(b.block_id for b in new)
        self._cache_full_blocks(req, blocks, total)
        return True

    def _cache_full_blocks(self, req: Request, blocks: list[Block], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        self._update_hashes(req)
        start = self.num_published.get(req.request_id, 0)
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        for i in range(start, end):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self.num_published[req.request_id] = max(start, end)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's blocks past its first num_tokens positions (rejected speculative tokens emptied them).
        Published blocks hold known tokens only, so they are never past the cut. The id list is replaced, not
        shortened: the runner keys its copy of a block-table row by that list."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        self.req_blocks[req.request_id] = blocks[:keep]
        self.req_block_ids[req.request_id] = self.req_block_ids[req.request_id][:keep]
        self.pool.free(reversed(blocks[keep:]))

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_block_ids.pop(req.request_id, None)
        self.num_published.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    @property
    def num_allocated_requests(self) -> int:
        return len(self.req_blocks)
