"""Draft-model proposals: a smaller model (or the same one) in the same process, with its own weights, KV cache,
compiled pieces (its own compile-cache key: a different model spec) and model runner.

Each request has a mirror here: its tokens as the draft last saw them and how many of them the draft's cache
holds. Before proposing, the mirror takes the target's tokens; the draft's cache stays valid up to the first
token that differs (the rejected proposals roll back). Then all proposing requests run batched: one step that
catches each up (the whole prompt the first time, chunked to the token budget) and samples its first
proposal, then k - 1 one-token steps. Proposals are the draft's argmax: a point mass, which the verify rule
(verify.py) turns into exact target sampling.
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.config import CacheConfig, RuntimeConfig
from kiln.runtime.kv.block_pool import BlockPool
from kiln.runtime.kv.hashing import block_hash_fn
from kiln.runtime.kv.manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def draft_runtime_config(config: RuntimeConfig, max_model_len: int, device: torch.device) -> RuntimeConfig:
    """The target's settings for the draft model, with a cache of its own (no prefix caching: mirrors are
    private). On a GPU it takes at most half of the memory the target left free."""
    cache_bytes = config.cache.kv_cache_bytes
    if device.type == "cuda" and config.cache.num_blocks is None:
        free, _ = torch.cuda.mem_get_info(device)
        cache_bytes = min(cache_bytes or free // 2, free // 2)
    cache = CacheConfig(block_size=config.cache.block_size, kv_cache_bytes=cache_bytes,
                        num_blocks=config.cache.num_blocks, enable_prefix_caching=False,
                        kv_cache_dtype=config.cache.kv_cache_dtype)
    scheduler = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
    return dataclasses.replace(config, model=config.speculative_config.model, speculative_config=None,
                               quantization=None, tensor_parallel_size=1, tokenizer=None, cache=cache,
                               scheduler=scheduler)


class DraftModelProposer:
    def __init__(self, worker, num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        """`worker`: a warmed-up kiln.runtime.worker.Worker over the draft model."""
        self.worker = worker
        self.runner = worker.runner
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.kv = KVCacheManager(BlockPool(worker.num_blocks, False), worker.config.cache.block_size,
                                 block_hash_fn("fast", 0))
        self.runner.block_ids_of = self.kv.block_ids_of
        self.mirrors: dict[str, Request] = {}
        self.synced: dict[str, int] = {}  # target tokens the mirror was last given (all before are equal)

    def _mirror(self, req: Request) -> Request:
        mirror = self.mirrors.get(req.request_id)
        if mirror is None:
            mirror = self.mirrors[req.request_id] = Request(req.request_id, req.token_ids, _GREEDY, frozenset(),
                                                            req.max_total_tokens + self.k)
        else:  # keep the draft's cache up to the first token that differs from the target's
            same, target, mine = self.synced[req.request_id], req.token_ids, mirror.token_ids
            end = min(len(target), len(mine))
            while same < end and target[same] == mine[same]:
                same += 1
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, same)
            mirror.token_ids = list(target)
        self.synced[req.request_id] = len(req.token_ids)
        return mirror

    def release(self, live: set[str]) -> None:
        """Drop the mirrors (and draft blocks) of requests that are no longer running."""
        for request_id in [r for r in self.mirrors if r not in live]:
            self.kv.free(self.mirrors.pop(request_id))
            del self.synced[request_id]

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        mirrors = [self._mirror(req) for req in reqs]
        wanted = {m.request_id: min(self.k, limit) for m, limit in zip(mirrors, limits)}
        drafts: dict[str, list[int]] = {m.request_id: [] for m in mirrors}
        active = [m for m in mirrors if wanted[m.request_id] > 0]
        while active:
            sched, budget = SchedulerOutput(), self.budget
            for mirror in active:
                n = min(mirror.num_tokens - mirror.num_computed_tokens, budget)
                if n <= 0 or len(sched.requests) == self.runner.max_num_seqs:
                    break
                if not self.kv.allocate(mirror, n):  # the draft's cache is full: no (more) proposals for it
                    wanted[mirror.request_id] = len(drafts[mirror.request_id])
                    continue
                sched.requests.append(mirror)
                sched.num_new_tokens.append(n)
                budget -= n
            if not sched.requests:
                break
            step = self.runner.execute(sched)
            for mirror, n in zip(sched.requests, sched.num_new_tokens):
                mirror.num_computed_tokens += n
            for row, token in zip(step.rows, step.token_ids()):
                mirror = sched.requests[row]
                mirror.token_ids.append(token)
                drafts[mirror.request_id].append(token)
            active = [m for m in active if len(drafts[m.request_id]) < wanted[m.request_id]]
        return [drafts[m.request_id] for m in mirrors]
