"""Sampler semantics on CPU: greedy, logprobs, per-request seeding, filters, min_tokens, penalties."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kiln.runtime.sampler import Sampler, SamplingBatch, apply_penalties
from kiln.runtime.sampling_params import SamplingParams

VOCAB = 64
EOS = 7


def make_batch(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
               prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
               eos: frozenset[int] = frozenset({EOS})) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params, generators=generators or [None] * n,
                         prompt_token_ids=prompts or [[] for _ in range(n)],
                         output_token_ids=outputs or [[] for _ in range(n)], eos_token_ids=eos)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _isolated_rng() -> Iterator[None]:
    # Unseeded rows use the global generator: fix it so nothing can flake, and restore it afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(5, VOCAB).to(dtype)
    original = logits.clone()
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 5))
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, original)  # the caller's logits are left alone
    # ties: plain greedy takes the argmax of the model-dtype logits, which must pick the fp32 path's index
    tied = torch.randint(0, 3, (5, VOCAB)).to(dtype)
    assert Sampler()(tied, make_batch([SamplingParams(temperature=0.0)] * 5)).token_ids == \
        tied.float().argmax(dim=-1).tolist()


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, VOCAB), make_batch([]))
    assert out.token_ids == [] and out.logprobs == []


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(3, VOCAB)
    raw_best = int(logits[0].argmax())
    params = [
        # A huge presence penalty on the raw argmax makes greedy pick another token; logprobs stay raw.
        SamplingParams(temperature=0.0, logprobs=5, presence_penalty=2.0),
        SamplingParams(temperature=0.8, logprobs=0, seed=3),
        SamplingParams(temperature=0.0),
    ]
    logits[0, raw_best] += 0.5  # make the penalty decisive but keep the winner well known
    expected = torch.log_softmax(logits, dim=-1)
    outputs = [[raw_best] * 4, [], []]
    out = Sampler()(logits, make_batch(params, [None, seeded(3), None], outputs=outputs))

    assert out.token_ids[0] != raw_best
    assert out.logprobs[2] is None
    for row, k in ((0, 5), (1, 0)):
        entry = out.logprobs[row]
        assert entry is not None
        token = out.token_ids[row]
        assert entry.sampled.token_id == token
        assert entry.sampled.logprob == pytest.approx(expected[row, token].item(), abs=1e-5)
        descending = expected[row].argsort(descending=True).tolist()
        assert entry.sampled.rank == descending.index(token) + 1
        assert [lp.token_id for lp in entry.top] == descending[:k]
        assert [lp.rank for lp in entry.top] == list(range(1, k + 1))
        for lp in entry.top:
            assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-5)
    assert out.logprobs[0] is not None and out.logprobs[0].sampled.rank == 2


def test_seeded_row_reproducible_regardless_of_batch() -> None:
    steps = 12
    target = SamplingParams(temperature=1.5, seed=42)
    # Nearly flat logits so the sequence is genuinely random, not just the argmax repeated.
    target_logits = [torch.randn(VOCAB) * 0.1 for _ in range(steps)]

    def run(position: int, others: list[tuple[SamplingParams, torch.Generator | None]]) -> list[int]:
        generator = seeded(42)
        sampler, tokens = Sampler(), []
        for step in range(steps):
            rows = [(p, g) for p, g in others]
            rows.insert(position, (target, generator))
            logits = torch.randn(len(rows), VOCAB)
            logits[position] = target_logits[step]
            out = sampler(logits, make_batch([p for p, _ in rows], [g for _, g in rows]))
            tokens.append(out.token_ids[position])
        return tokens

    alone = run(0, [])
    assert len(set(alone)) > 3
    others = [(SamplingParams(temperature=1.0), None), (SamplingParams(temperature=0.7, seed=7), seeded(7)),
              (SamplingParams(temperature=0.0), None), (SamplingParams(top_k=5, seed=42), seeded(42))]
    assert run(0, others) == alone
    assert run(2, others) == alone
    assert run(4, others[::-1]) == alone
    assert run(1, others[:1]) == alone


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(top_k=3, top_p=1e-6), SamplingParams(min_p=1.0)])
def test_tight_filters_equal_greedy(params: SamplingParams) -> None:
    logits = torch.randn(16, VOCAB) * 2
    out = Sampler()(logits, make_batch([params] * 16))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)] * 3
    out = Sampler()(logits, make_batch(params))
    top2 = logits.topk(2, dim=-1).indices
    for row, token in enumerate(out.token_ids):
        if row % 2 == 0:
            assert token == int(logits[row].argmax())
        else:
            assert token in top2[row].tolist()


def test_filters_limit_support() -> None:
    # probs 0.5, 0.3, 0.15, 0.05
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    sampler = Sampler()
    cases = {
        SamplingParams(min_p=0.2): {0, 1, 2},  # threshold 0.1 drops only the 0.05 token
        SamplingParams(min_p=0.5): {0, 1},  # threshold 0.25
        SamplingParams(top_k=2): {0, 1},
        SamplingParams(top_p=0.7): {0, 1},  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it
        SamplingParams(top_p=0.85, min_p=0.5): {0, 1},  # top_p keeps 3 tokens, min_p then cuts to 2
    }
    for params, support in cases.items():
        assert set(sampler(logits, make_batch([params] * 4000)).token_ids) == support, params


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 3], logits[0, 9], logits[0, 11] = 10.0, 9.0, 8.0, 7.0
    sampler = Sampler()

    def greedy(outputs: list[int], min_tokens: int = 0, ignore_eos: bool = False) -> int:
        params = SamplingParams(temperature=0.0, stop_token_ids=(3, 9), max_tokens=8, min_tokens=min_tokens,
                                ignore_eos=ignore_eos)
        return sampler(logits, make_batch([params], outputs=[outputs])).token_ids[0]

    assert greedy([], min_tokens=2) == 11
    assert greedy([5], min_tokens=2) == 11
    assert greedy([5, 5], min_tokens=2) == EOS  # min_tokens reached: ending is allowed again
    assert greedy([]) == EOS
    # ignore_eos: EOS cannot end the request anyway, so only the stop ids are masked.
    assert greedy([], min_tokens=2, ignore_eos=True) == EOS
    logits[0, EOS] = 0.0
    assert greedy([], min_tokens=2, ignore_eos=True) == 11


def test_penalties_match_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 0.0]] * 3)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(frequency_penalty=-1.0),
    ]
    batch = make_batch(params, prompts=[[0, 1]] * 3, outputs=[[3, 3, 4]] * 3)
    apply_penalties(logits, batch)
    expected = torch.tensor([
        # repetition over {0, 1, 3, 4}: /2 if positive else *2; then -0.5 presence, -0.25 per occurrence.
        [1.0, -2.0, 0.5, 1.5 - 0.5 - 2 * 0.25, -1.0 - 0.5 - 0.25, 0.0],
        [2.0, -1.0, 0.5, 3.0, -0.5, 0.0],
        [2.0, -1.0, 0.5, 3.0 + 2.0, -0.5 + 1.0, 0.0],
    ])
    torch.testing.assert_close(logits, expected)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    prompt, output = [[0]], [[]]
    assert Sampler()(logits, make_batch([SamplingParams(temperature=0.0, repetition_penalty=2.0)],
                                        prompts=prompt, outputs=output)).token_ids == [1]
    # presence/frequency only look at the output, not the prompt
    assert Sampler()(logits, make_batch([SamplingParams(temperature=0.0, presence_penalty=2.0)],
                                        prompts=prompt, outputs=output)).token_ids == [0]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_distribution_matches_softmax(temperature: float) -> None:
    draws = 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    params = [SamplingParams(temperature=temperature)] * draws
    out = Sampler()(logits.expand(draws, 5).clone(), make_batch(params))
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()

    def chi_square(probs: torch.Tensor) -> float:
        expected = probs.double() * draws
        return float(((observed - expected) ** 2 / expected).sum())

    # 4 degrees of freedom: 18.5 is the p = 0.001 critical value; the global seed is fixed by the fixture.
    assert chi_square(torch.softmax(logits / temperature, dim=-1)) < 18.5
    other = 1.0 if temperature != 1.0 else 0.7
    assert chi_square(torch.softmax(logits / other, dim=-1)) > 100


def test_seeded_rows_follow_softmax() -> None:
    # Same check through the per-row generator path, with every row its own seed.
    rows = 3000
    logits = torch.tensor([1.0, 0.0, -1.0])
    batch = make_batch([SamplingParams(seed=i) for i in range(rows)], [seeded(i) for i in range(rows)])
    out = Sampler()(logits.expand(rows, 3).clone(), batch)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=3).double()
    expected = torch.softmax(logits, dim=-1).double() * rows
    assert float(((observed - expected) ** 2 / expected).sum()) < 13.8  # 2 dof, p = 0.001


def test_logit_bias_moves_greedy_and_sampled_rows_alone() -> None:
    """A bias is added to its own row's logits only (after the raw logprobs are taken): +100 forces a token in a
    sampled row, -100 bans the argmax of a greedy one, a small bias reorders close logits, other rows keep theirs."""
    logits = torch.zeros(4, VOCAB)
    logits[:, 5], logits[:, 6] = 4.0, 3.5
    params = [SamplingParams(temperature=0.0, logit_bias={6: 1.0}),
              SamplingParams(temperature=0.0, logit_bias={5: -100.0}, logprobs=0),
              SamplingParams(temperature=1.0, seed=3, logit_bias={40: 100.0}),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits.clone(), make_batch(params, generators=[None, None, seeded(3), None]))
    assert out.token_ids == [6, 6, 40, 5]
    raw = torch.log_softmax(logits[1], dim=-1)
    assert out.logprobs[1].sampled.logprob == pytest.approx(raw[6].item())  # the model's, not the biased one
    assert Sampler()(logits[:1].clone(), make_batch([SamplingParams(temperature=0.0, logit_bias={6: 0.4})])
                     ).token_ids == [5]


def test_logit_bias_is_validated_and_kept_as_sorted_pairs() -> None:
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(4, 2.0)]) == SamplingParams(logit_bias={4: 2.0})
    for bad in ({-1: 1.0}, {"7": 1.0}, {3: 101.0}, {3: float("nan")}, {3: "high"}):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)


def test_allowed_token_ids_confine_greedy_and_sampled_rows() -> None:
    """Only the allowed ids can come out (greedy takes the best of them), logprobs stay the model's, and the ids
    are checked and kept sorted."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    allowed = (3, 17, 40)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[40, 3, 17], logprobs=0),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits.clone(), make_batch(params))
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[1] in allowed and out.token_ids[2] == int(logits[2].argmax())
    assert out.logprobs[0].sampled.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[out.token_ids[0]].item())
    assert params[0].allowed_token_ids == allowed
    for bad in ([], [-1], ["7"], [1, "7"]):
        with pytest.raises(ValueError, match="^allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_bad_words_ban_the_token_that_completes_them() -> None:
    """A one-token word is banned at every step; a longer one only where the output ends with the rest of it."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 9], logits[:, 4] = 5.0, 4.0
    words = ((9,), (2, 3, 4))
    params = [SamplingParams(temperature=0.0, bad_words=("x",))] * 3
    outputs = [[1, 2], [2, 3], [3, 2]]
    out = Sampler()(logits, SamplingBatch(params, [None] * 3, [[]] * 3, outputs, frozenset({EOS}),
                                          bad_words=[words] * 3))
    assert out.token_ids == [4, 0, 4]  # row 1 ends with (2, 3): 4 is banned too, and 0 leads the tied rest
    with pytest.raises(ValueError, match="^bad_words"):
        SamplingParams(bad_words=[" "])
