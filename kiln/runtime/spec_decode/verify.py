"""The verify step: the target's tokens at the last known token and at each proposal, and how many proposals
they accept.

Every row is sampled by the ordinary sampler, as if the proposals before it were already the request's output
(penalties and min_tokens see them; logprobs come from that row's raw logits). Proposals are accepted while
they equal the target's own token at their position; the first differing target token (or, when all are
accepted, the token after the last proposal) ends the run. So each verified request gets 1 to k + 1 tokens.

Why this is the accept/resample rule: kiln's proposals are deterministic (an n-gram match, or the draft model's
argmax), i.e. the draft distribution q is a point mass on the proposed token d. The rule accepts d with
probability min(1, p(d) / q(d)) = p(d) and otherwise samples from max(0, p - q) renormalised = p with d
removed. Drawing x ~ p and accepting iff x == d does exactly that: P(accept) = p(d), and given x != d, x is
distributed as p without d. Greedy is the temperature-0 case: the argmax must equal d. Output is therefore
distributed as non-speculative sampling (tests/runtime/spec_decode/test_rejection.py checks it with a
chi-square), and a seeded request draws only from its own generator, so it reproduces.
"""

from __future__ import annotations

import torch

from kiln.runtime.async_step import LaunchedStep
from kiln.runtime.sampler import Sampler, SamplingBatch
from kiln.runtime.scheduler import SchedulerOutput


def accepted_length(target_tokens: list[int], proposals: list[int]) -> int:
    """How many proposals the target's tokens accept: the length of their common prefix."""
    for j, proposal in enumerate(proposals):
        if target_tokens[j] != proposal:
            return j
    return len(proposals)


def sample_rows(sampler: Sampler, logits: torch.Tensor, sched: SchedulerOutput, rows: list[int],
                eos_token_ids: frozenset[int]) -> tuple[list[int], list]:
    """One token per logits row; row r of request i sees the request's output plus its first j proposals."""
    params, generators, prompts, outputs = [], [], [], []
    previous, j = -1, 0
    for i in rows:
        j = j + 1 if i == previous else 0
        previous = i
        req = sched.requests[i]
        params.append(req.params)
        generators.append(req.generator)
        prompts.append(req.prompt_token_ids)
        outputs.append(req.output_token_ids + req.spec_token_ids[:j] if j else req.output_token_ids)
    # a request verified behind the step in flight has that step's token pending (min_tokens counts it)
    pending = [sched.requests[i].num_pending_tokens for i in rows]
    bad_words = [sched.requests[i].bad_words_token_ids for i in rows]
    tokens, logprobs = sampler.sample(logits, SamplingBatch(params, generators, prompts, outputs, eos_token_ids,
                                                            pending, bad_words if any(bad_words) else None))
    return tokens.tolist(), logprobs


def verify_step(sampler: Sampler, sched: SchedulerOutput, rows: list[int], logits: torch.Tensor,
                eos_token_ids: frozenset[int], accept=accepted_length) -> LaunchedStep:
    """The step's outcome, read back now (a verify step is synchronous): one entry in `rows` per emitted token,
    and per verified request (row -> (proposals, accepted)) for the scheduler's roll-back."""
    sampled, logprobs = sample_rows(sampler, logits, sched, rows, eos_token_ids)
    out_rows: list[int] = []
    out_tokens: list[int] = []
    out_logprobs: list = []
    verified: dict[int, tuple[int, int]] = {}
    start = 0
    while start < len(rows):
        i = rows[start]
        proposals = sched.requests[i].spec_token_ids
        end = start + len(proposals) + 1
        accepted = accept(sampled[start:end], proposals)
        out_rows += [i] * (accepted + 1)
        out_tokens += sampled[start:start + accepted + 1]
        out_logprobs += logprobs[start:start + accepted + 1]
        if proposals:
            verified[i] = (len(proposals), accepted)
        start = end
    return LaunchedStep(sched, out_rows, out_logprobs, verified=verified, _token_ids=out_tokens)
