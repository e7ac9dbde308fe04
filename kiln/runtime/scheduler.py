"""Continuous batching with chunked prefill, prefix hits and preemption by recompute.

There is no prefill/decode distinction: each request has `num_computed_tokens` and a known token count;
a step advances it by a chunk bounded by the token budget. Running requests go first (so decodes are
never starved by prefills); when blocks run out the most recently admitted running request is preempted
(its blocks freed, its progress reset) and requeued at the front of the waiting queue.

With overlapped scheduling a request may have a token still on the device (`num_pending_tokens`): it is
scheduled as if that token were known (the runner copies its value on the device), never past its length
limit, and, once preempted, not readmitted before the value reaches the host (recompute needs it).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config import SchedulerConfig
from kiln.runtime.kv.manager import KVCacheManager
from kiln.runtime.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_spec_tokens: int = 0  # speculative proposals scheduled for verification (counted in num_new_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def samples(self, i: int) -> bool:
        """Request i reaches its last known (or pending) token this step, so it gets logits and a new token."""
        req = self.requests[i]
        return req.num_computed_tokens + self.num_new_tokens[i] >= req.num_tokens_with_pending

    def num_drafts(self, i: int) -> int:
        """Speculative proposals of request i scheduled after its known tokens (each gets logits too)."""
        req = self.requests[i]
        return max(0, req.num_computed_tokens + self.num_new_tokens[i] - req.num_tokens_with_pending)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """ValueError if the request could never run: its id is taken, or it needs more KV than the pool has."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.max_total_tokens > self.kv.capacity_tokens:
            raise ValueError(
                f"max_tokens too large for the KV cache: request {req.request_id!r} may need "
                f"{req.max_total_tokens} tokens of it but the pool holds only {self.kv.capacity_tokens}; lower "
                "max_tokens or give the KV cache more memory"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and req.num_tokens_with_pending >= req.max_total_tokens:
                i += 1  # its in-flight token is its last: it finishes (length) when that lands
                continue
            known = req.num_tokens_with_pending - req.num_computed_tokens
            # the token budget counts proposals, and a slot is reserved for each
            num_new = self._chunk(req, known + len(req.spec_token_ids), budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                if req.spec_token_ids:  # keep the proposals the chunk covers
                    del req.spec_token_ids[max(0, num_new - known):]
                    out.num_spec_tokens += len(req.spec_token_ids)
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _chunk(self, req: Request, remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            remaining = min(remaining, threshold)
        return min(remaining, budget)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending_tokens:
                # preempted with its token in flight: recompute needs the value. The engine processes that step
                # before the next schedule, so this only guards the invariant (FCFS: nothing overtakes it).
                break
            prefix, num_hit = self.kv.find_prefix(req)
            num_new = self._chunk(req, req.num_tokens - num_hit, budget)
            if not self.kv.allocate(req, num_new, prefix):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            req.num_shared_tokens = len(prefix) * self.kv.block_size
            if req.metrics.first_scheduled_time is None:
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_tokens, num_hit)
                req.metrics.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_shared_tokens = 0
        req.spec_token_ids = []  # proposals in flight are dropped: they are proposed again once it runs
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def advance(self, out: SchedulerOutput) -> None:
        """Record a launched step: its tokens count as computed, and each sampling request has one more
        token pending until the engine appends it."""
        for i, (req, num_new) in enumerate(zip(out.requests, out.num_new_tokens)):
            if out.samples(i):
                req.num_pending_tokens += 1
            req.num_computed_tokens += num_new

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted) and free its blocks at once."""
        if req.finished:
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        req.metrics.finished_time = time.time()

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
