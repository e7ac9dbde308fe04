"""The engine's side of speculative decoding: propose before a step is scheduled, roll back after it is verified.

A decoding request gets up to k proposals (never past its length limit); the scheduler counts them in the
token budget and reserves their KV slots; the runner verifies them in one forward (verify.py). After the
step each verified request keeps its accepted proposals: the rejected ones' positions are rolled back
(`num_computed_tokens`) and blocks they alone occupied are freed. The prefix cache only ever publishes blocks
of known tokens, so it holds accepted tokens only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.config import RuntimeConfig
from kiln.models.loader.load import resolve_model_source
from kiln.runtime.async_step import LaunchedStep
from kiln.runtime.kv.manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.spec_decode.ngram import NgramProposer

logger = logging.getLogger("kiln")

MAX_SKIP = 32  # the most steps a request with rejected proposals sits out


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify rows with at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: proposals accepted at position j

    def as_dict(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


class SpecDecoder:
    def __init__(self, proposer, num_speculative_tokens: int, kv: KVCacheManager) -> None:
        self.proposer = proposer  # propose(requests, limits) -> proposals per request
        self.k = num_speculative_tokens
        self.kv = kv
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        # request id -> (verify steps in a row that accepted nothing, the step its proposals resume at): a
        # request whose proposals keep failing (free-form text under n-gram) backs off exponentially, up to
        # MAX_SKIP steps, so it decodes plainly instead of paying for k rejected tokens a step; any acceptance
        # resets it
        self.backoff: dict[str, tuple[int, int]] = {}
        self.step = 0  # engine steps begun (`next_step`): the clock of the backoff
        # requests `wants_verify` expected proposals for (the step in flight is drained for them): one whose
        # lookup on its complete context then finds none counts a miss, like a rejection, so free-form text
        # does not drain the overlapped steps for lookups that keep failing
        self.expected: set[str] = set()
        # fill short proposals up to k (or the length limit): with FULL CUDA graphs for verify batches of k + 1
        # tokens a request, a shorter verify runs PIECEWISE graphs with eager attention between them, whose
        # launches cost the host several times a FULL replay (docs/spec_decode.md)
        self.pad_proposals = False

    def next_step(self) -> None:
        self.step += 1

    def _eligible(self, req: Request, room: int) -> bool:
        return room > 0 and self.backoff.get(req.request_id, (0, 0))[1] <= self.step

    def wants_verify(self, running: list[Request]) -> bool:
        """Async scheduling: would a decoding request get proposals from the tokens already on the host (the
        one in flight aside)? Only then is the step in flight drained for a synchronous verify; otherwise the
        next step is launched overlapped, as without speculation. A draft model always proposes."""
        if not isinstance(self.proposer, NgramProposer):
            return True
        self.expected.clear()
        for req in running:
            decoding = req.num_pending_tokens or req.num_computed_tokens == req.num_tokens - 1
            room = req.max_total_tokens - req.num_tokens_with_pending - 1
            if decoding and self._eligible(req, room) and self.proposer.propose([req], [room])[0]:
                self.expected.add(req.request_id)
        return bool(self.expected)

    def propose_ahead(self, running: list[Request]) -> bool:
        """Async scheduling with a plain step in flight (n-gram only): proposals for each request whose pending
        token is its next input and whose last verify accepted something, looked up from the tokens on the host
        past the lookup's guess for the pending one. They are verified behind the step in flight, which then
        need not be drained first; a wrong guess costs only the proposals (the target's own token at each
        position decides) and counts as a miss like any rejection. A request not copying at the moment (no
        verify yet, or its last one rejected) is proposed for from its complete context instead, after a drain:
        on free text the guesses fail, and each failed verify behind costs about a plain step. Sets
        `spec_token_ids` (cleared elsewhere); -> whether any request got proposals."""
        return bool(self._propose_past_pending(running, lambda req, room: (
            self.backoff.get(req.request_id, (1, 0))[0] == 0 and self._eligible(req, room))))

    def propose_on_guess(self, running: list[Request]) -> dict[str, int]:
        """Async scheduling, a plain step in flight, after `wants_verify` (n-gram only): for each request it expected
        proposals for whose pending token is its next input, the lookup's guess for that token and the proposals
        that follow the guess (`spec_token_ids`, cleared for every other request). The engine prepares that verify
        while the step in flight runs and launches it once the pending tokens are seen to match the guesses;
        otherwise it drops it and drains as before, so a wrong guess costs no verify (unlike `propose_ahead`'s,
        launched at once). -> request id -> guess, for the requests with proposals."""
        proposed = self._propose_past_pending(running, lambda req, room: req.request_id in self.expected and room > 0)
        # proposals past the guess mean the lookup's continuation holds the guess itself
        guesses = self.proposer.propose(proposed, [1] * len(proposed)) if proposed else []
        return {req.request_id: guess[0] for req, guess in zip(proposed, guesses)}

    def _propose_past_pending(self, running: list[Request], wanted: Callable[[Request, int], bool]) -> list[Request]:
        """n-gram proposals past the lookup's guess for the pending token, for each request whose pending token is
        its next input and that is `wanted` (given its room for tokens); sets `spec_token_ids` (cleared for the
        rest) -> the requests that got proposals."""
        if not isinstance(self.proposer, NgramProposer):
            return []
        reqs, limits = [], []
        for req in running:
            req.spec_token_ids = []
            room = req.max_total_tokens - req.num_tokens_with_pending - 1
            if req.num_pending_tokens == 1 and req.num_computed_tokens == req.num_tokens and wanted(req, room):
                reqs.append(req)
                limits.append(room)
        proposed = []
        for req, limit, proposal in zip(reqs, limits, self.proposer.propose(reqs, limits, skip=1) if reqs else []):
            if proposal:
                req.spec_token_ids = self._padded(proposal, limit)
                proposed.append(req)
        return proposed

    def _padded(self, proposal: list[int], limit: int) -> list[int]:
        """A short proposal repeats its last token up to min(k, limit) when `pad_proposals`: the fillers are
        proposals like any other (accepted only where the target's own token equals them), so outputs are
        unchanged, and the verify batch keeps its FULL graph's shape."""
        want = min(self.k, limit)
        if not self.pad_proposals or not proposal or len(proposal) >= want:
            return proposal
        return proposal + [proposal[-1]] * (want - len(proposal))

    def propose(self, running: list[Request], paused: bool = False) -> None:
        """Set `spec_token_ids` of every running request that decodes next (one known token left to compute);
        `paused`: none this step (each request's proposals are cleared)."""
        reqs, limits = [], []
        for req in running:
            req.spec_token_ids = []
            # each step emits at most proposals + 1 tokens: stay within max_tokens / max_model_len
            room = req.max_total_tokens - req.num_tokens - 1
            if (not paused and not req.num_pending_tokens and req.num_computed_tokens == req.num_tokens - 1
                    and self._eligible(req, room)):
                reqs.append(req)
                limits.append(room)
        if len(self.backoff) > 2 * len(running):
            live = {req.request_id for req in running}
            self.backoff = {r: b for r, b in self.backoff.items() if r in live}
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release({req.request_id for req in running})
        if reqs:
            for req, limit, proposal in zip(reqs, limits, self.proposer.propose(reqs, limits)):
                req.spec_token_ids = self._padded(proposal, limit)
                if not proposal and req.request_id in self.expected:
                    self._count(req.request_id, accepted=False)
        self.expected.clear()

    def _count(self, request_id: str, accepted: bool) -> None:
        """The backoff after a verify (or a drain that found nothing to verify): reset by an acceptance, else
        the request sits out 2^misses - 1 steps, at most MAX_SKIP."""
        misses = 0 if accepted else self.backoff.get(request_id, (0, 0))[0] + 1
        self.backoff[request_id] = (misses, self.step + 1 + min(2 ** misses - 1, MAX_SKIP))

    def after_verify(self, sched: SchedulerOutput, step: LaunchedStep) -> None:
        """After `Scheduler.advance`: each verified request emits accepted + 1 tokens (one was counted pending
        already), and the positions of its rejected proposals are no longer computed."""
        stats = self.stats
        for row, (proposed, accepted) in step.verified.items():
            req = sched.requests[row]
            req.num_pending_tokens += accepted
            req.num_computed_tokens -= proposed - accepted
            req.spec_token_ids = []
            self.kv.trim(req, req.num_computed_tokens)
            self._count(req.request_id, accepted > 0)
            stats.num_drafts += 1
            stats.num_draft_tokens += proposed
            stats.num_accepted_tokens += accepted
            for j in range(accepted):
                stats.accepted_per_pos[j] += 1


def build_spec_decoder(config: RuntimeConfig, kv: KVCacheManager, target_vocab: int, max_model_len: int,
                       device: torch.device) -> SpecDecoder:
    spec = config.speculative_config
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        proposer: Any = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from kiln.runtime.spec_decode.draft_model import DraftModelProposer, draft_runtime_config
        from kiln.runtime.worker import Worker

        try:  # the config alone says whether the vocabularies match: fail before loading any weights
            draft_vocab = resolve_model_source(spec.model)[1].vocab_size
            if draft_vocab != target_vocab:
                raise ValueError(f"has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: a draft "
                                 "must share the target's vocabulary")
            worker = Worker(draft_runtime_config(config, max_model_len, device), device)
        except ValueError as exc:
            raise ValueError(f"speculative_config model {spec.model!r} {exc}") from exc
        worker.warm_up()
        proposer = DraftModelProposer(worker, k, config.scheduler.max_num_batched_tokens)
        logger.info("speculative decoding: draft model %s, %d KV blocks", spec.model, worker.num_blocks)
    logger.info("speculative decoding: %s, %d proposals a step", spec.method, k)
    return SpecDecoder(proposer, k, kv)
