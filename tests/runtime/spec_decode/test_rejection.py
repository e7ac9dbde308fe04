"""The verify rule samples as non-speculative decoding does: a chi-square over many sequences of a small Markov
"model" (6 tokens, logits by previous token), drawn token by token by the sampler versus by speculative steps of
k = 3 proposals from a different, deterministic drafter (a point mass, as kiln's proposers are). The same
statistic must flag a broken rule (the classic bug: on rejection, resampling from the full target distribution
instead of the one without the rejected token), so the test can fail."""

from __future__ import annotations

import math
from collections import Counter

import torch

from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.spec_decode.verify import accepted_length, sample_rows, verify_step

VOCAB, K, LENGTH, N = 6, 3, 4, 4000
PARAMS = SamplingParams(temperature=0.9, max_tokens=None)


def tables() -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 1.5  # row: previous token
    # a point-mass draft per token: the target's argmax under some noise (right often, not always)
    drafter = (logits + torch.randn(VOCAB, VOCAB, generator=g) * 1.5).argmax(dim=1).tolist()
    return logits, drafter


def plain_sequences(logits: torch.Tensor) -> list[tuple[int, ...]]:
    sampler, seqs = Sampler(), [[0] for _ in range(N)]
    for _ in range(LENGTH):
        reqs = [Request(str(i), s, PARAMS, frozenset(), 100) for i, s in enumerate(seqs)]
        sched = SchedulerOutput(requests=reqs, num_new_tokens=[1] * N)
        tokens, _ = sample_rows(sampler, logits[[s[-1] for s in seqs]], sched, list(range(N)), frozenset())
        for s, t in zip(seqs, tokens):
            s.append(t)
    return [tuple(s[1:LENGTH + 1]) for s in seqs]


def speculative_sequences(logits: torch.Tensor, drafter: list[int], verify) -> list[tuple[int, ...]]:
    sampler, seqs = Sampler(), [[0] for _ in range(N)]
    while min(len(s) for s in seqs) <= LENGTH:
        reqs, rows, contexts = [], [], []
        for i, s in enumerate(seqs):
            proposals = [drafter[s[-1]]]
            while len(proposals) < K:
                proposals.append(drafter[proposals[-1]])
            req = Request(str(i), s, PARAMS, frozenset(), 100)
            req.spec_token_ids = proposals
            reqs.append(req)
            rows += [i] * (K + 1)
            contexts += [s[-1], *proposals]  # the logits row of each position is that of its input token
        sched = SchedulerOutput(requests=reqs, num_new_tokens=[K + 1] * N, num_spec_tokens=K * N)
        for row, token in verify(sampler, sched, rows, logits[contexts]):
            seqs[row].append(token)
    return [tuple(s[1:LENGTH + 1]) for s in seqs]


def kiln_verify(sampler, sched, rows, logits):
    step = verify_step(sampler, sched, rows, logits, frozenset())
    return zip(step.rows, step.token_ids())


def resample_from_full_target(sampler, sched, rows, logits):
    """Broken on purpose: accept with probability p(d), but on rejection draw from all of p (d included)."""
    decide, _ = sample_rows(sampler, logits, sched, rows, frozenset())
    fresh, _ = sample_rows(sampler, logits, sched, rows, frozenset())
    out, start = [], 0
    while start < len(rows):
        i = rows[start]
        proposals = sched.requests[i].spec_token_ids
        a = accepted_length(decide[start:start + K + 1], proposals)
        out += [(i, t) for t in proposals[:a]] + [(i, fresh[start + a])]
        start += K + 1
    return out


def chi_square(a: list, b: list) -> tuple[float, float]:
    """Two-sample chi-square over the cells either sample hit, and its 0.1% critical value (Wilson-Hilferty)."""
    ca, cb = Counter(a), Counter(b)
    cells = set(ca) | set(cb)
    stat = sum((ca[c] - cb[c]) ** 2 / (ca[c] + cb[c]) for c in cells)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def statistics(seqs_a, seqs_b) -> list[tuple[float, float]]:
    """Per position the marginal, plus the joint of the first two tokens."""
    out = [chi_square([s[j] for s in seqs_a], [s[j] for s in seqs_b]) for j in range(LENGTH)]
    out.append(chi_square([s[:2] for s in seqs_a], [s[:2] for s in seqs_b]))
    return out


def test_speculative_sampling_matches_plain_sampling() -> None:
    logits, drafter = tables()
    torch.manual_seed(0)
    plain = plain_sequences(logits)
    spec = speculative_sequences(logits, drafter, kiln_verify)
    # the drafter must be right often enough for acceptance to matter
    assert sum(s[0] == drafter[0] for s in spec) > N // 10
    for stat, critical in statistics(plain, spec):
        assert stat < critical


def test_the_statistic_catches_a_broken_rule() -> None:
    logits, drafter = tables()
    torch.manual_seed(0)
    plain = plain_sequences(logits)
    broken = speculative_sequences(logits, drafter, resample_from_full_target)
    assert any(stat > critical for stat, critical in statistics(plain, broken))
