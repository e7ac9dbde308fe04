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
                eos_token_ids: frozenset[int]) -> tuple[torch.Tensor, list]:
    """One token per logits row, left on the device; row r of request i sees the request's output plus its
    first j proposals."""
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
    # the tokens of steps still in flight count towards min_tokens (the engine lets a step run behind a
    # verify only once min_tokens is met, so an optimistic count there changes nothing)
    pending = [sched.requests[i].num_pending_tokens for i in rows]
    return sampler.sample(logits, SamplingBatch(params, generators, prompts, outputs, eos_token_ids, pending))


def shortfall_on_device(tokens: torch.Tensor, rows: list[int], proposals: dict[int, list[int]]) -> torch.Tensor:
    """Per sampled row, on the device: at each request's last row, how many of its proposals the samples
    rejected (k - accepted); 0 elsewhere. A step launched behind the verify before its samples reach the host
    places its token there: its inputs were written as if every proposal was accepted, and this shifts them
    back (`ModelRunner._copy_pending_tokens`)."""
    width = max((len(p) for p in proposals.values()), default=0)
    gather, expect, last, counts = [], [], [], []
    start = 0
    while start < len(rows):
        props = proposals.get(rows[start], [])
        end = start + len(props)  # the request's last row
        # row start + j is the target's token where proposal j was guessed; padding repeats the last row,
        # whose expected -1 never matches, so the product stops there
        gather += [start + j for j in range(len(props))] + [end] * (width + 1 - len(props))
        expect += props + [-1] * (width + 1 - len(props))
        last.append(end)
        counts.append(len(props))
        start = end + 1
    host = torch.tensor(gather + expect + last + counts, dtype=torch.int64)
    index = host.to(tokens.device, non_blocking=True)
    n = len(last)
    g, e = index[: n * (width + 1)].view(n, -1), index[n * (width + 1): 2 * n * (width + 1)].view(n, -1)
    accepted = (tokens[g] == e).to(torch.int64).cumprod(dim=1).sum(dim=1)
    shortfall = torch.zeros_like(tokens)
    shortfall[index[2 * n * (width + 1): -n]] = index[-n:] - accepted
    return shortfall


def accept(step: LaunchedStep, accept_fn=accepted_length) -> None:
    """Turn a verify step's sampled rows, once on the host, into its outcome: one entry in `rows` per emitted
    token, and per verified request (row -> (proposals, accepted)) for the scheduler's roll-back."""
    sampled, rows, logprobs = step.token_ids(), step.rows, step.logprobs
    out_rows: list[int] = []
    out_tokens: list[int] = []
    out_logprobs: list = []
    verified: dict[int, tuple[int, int]] = {}
    start = 0
    while start < len(rows):
        i = rows[start]
        proposals = step.proposals.get(i, [])
        end = start + len(proposals) + 1
        accepted = accept_fn(sampled[start:end], proposals)
        out_rows += [i] * (accepted + 1)
        out_tokens += sampled[start:start + accepted + 1]
        out_logprobs += logprobs[start:start + accepted + 1]
        if proposals:
            verified[i] = (len(proposals), accepted)
        start = end
    step.rows, step.logprobs, step._token_ids, step.verified = out_rows, out_logprobs, out_tokens, verified
    step.proposals = None


def verify_step(sampler: Sampler, sched: SchedulerOutput, rows: list[int], logits: torch.Tensor,
                eos_token_ids: frozenset[int], accept_fn=accepted_length) -> LaunchedStep:
    """A verify step's outcome, read back at once (the tests' entry: the runner launches the sampling and
    the engine calls `accept` once the samples land)."""
    sampled, logprobs = sample_rows(sampler, logits, sched, rows, eos_token_ids)
    step = LaunchedStep(sched, list(rows), logprobs, _token_ids=sampled.tolist(),
                        proposals={i: list(sched.requests[i].spec_token_ids) for i in set(rows)})
    accept(step, accept_fn)
    return step
