"""`speculative_config` is checked at start with errors that name what is wrong; the n-gram lookup; the KV
manager's trim of rejected positions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kiln import Runtime
from kiln.config import SpeculativeConfig
from kiln.entrypoints.cli.main import parse_speculative_config
from kiln.runtime.async_step import LaunchedStep
from kiln.runtime.kv.block_pool import BlockPool
from kiln.runtime.kv.hashing import block_hash_fn
from kiln.runtime.kv.manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.spec_decode.decoder import SpecDecoder
from kiln.runtime.spec_decode.ngram import NgramIndex, NgramProposer


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "3"}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "draft_model", "model": 5, "num_speculative_tokens": 2}, "model"),
    ({"num_speculative_tokens": 2}, "method"),
])
def test_bad_configs_fail_at_start_naming_the_field(value, words) -> None:
    with pytest.raises(ValueError, match=words):
        Runtime("tiny-llama", device="cpu", level=0, speculative_config=value)


def test_config_from_vllm_dict() -> None:
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                           "prompt_lookup_min": 2})
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == \
        ("ngram", 3, 5, 2)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')["method"] == "ngram"


@pytest.mark.parametrize("value, expected", [
    ({"model": "[ngram]", "num_speculative_tokens": 3}, ("ngram", None, 1, 4)),
    ({"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": None}, ("ngram", None, 1, 4)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5}, ("ngram", None, 5, 5)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, ("ngram", None, 2, 2)),
    ({"model": "tiny-llama", "num_speculative_tokens": 3}, ("draft_model", "tiny-llama", 1, 4)),
])
def test_vllm_shorthands(value, expected) -> None:
    """vLLM's: the ngram method named through `model` or as "[ngram]", a `model` alone meaning a draft model, one
    lookup bound setting the other, null meaning unset."""
    config = SpeculativeConfig.from_value(value)
    assert (config.method, config.model, config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="speculative_config model .*vocabulary of 49152"):
        Runtime(str(tiny_checkpoint("tiny-llama")[0]), device="cpu", level=0, dtype="fp32",
                speculative_config={"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 2})


def scan_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The oracle: scan the whole context for the longest suffix (n_max..n_min) that occurred earlier, first hit."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            return arr[int(hits[0]) + n:int(hits[0]) + n + k].tolist()
    return []


def lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    return NgramIndex(n_min, n_max).propose(tokens, k)


def test_ngram_lookup() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 6, 7, 8]
    # the longest suffix found earlier (6 7 8, first at 1): what followed it there
    assert lookup(tokens, 3, 1, 4) == [9, 1, 6]
    assert lookup(tokens, 1, 1, 4) == [9]
    assert lookup([1, 2, 3, 4], 3, 1, 4) == []  # nothing repeats
    assert lookup([4, 4], 3, 1, 4) == [4]  # only what exists before the end
    assert lookup([1, 2, 9, 2], 3, 2, 4) == []  # suffixes shorter than the minimum are not used
    # one token in flight: the proposals start after the lookup's guess for it (9), at most k of them
    assert NgramIndex(1, 4).propose(tokens, 2, skip=1) == [1, 6]
    assert NgramIndex(1, 4).propose([4, 4], 3, skip=1) == []  # nothing known beyond the guess


def test_verify_behind_the_step_in_flight_only_while_copying() -> None:
    """With a token in flight, proposals past the lookup's guess for it are made only for a request whose last
    verify accepted something; a rejection there backs off like any other."""
    kv = KVCacheManager(BlockPool(16, enable_caching=False), 4, block_hash_fn("fast", 0))
    spec = SpecDecoder(NgramProposer(3, 1, 4), 3, kv)
    req = Request("r", [5, 6, 7, 8, 9, 1, 6, 7, 8], SamplingParams(max_tokens=30), frozenset(), 64)

    def verify(accepted: int, appended: list[int]) -> None:  # schedule, advance, verify, append the tokens
        n = len(req.spec_token_ids) + 1
        sched = SchedulerOutput([req], [n], num_spec_tokens=n - 1)
        assert kv.allocate(req, n)
        req.num_computed_tokens += n
        req.num_pending_tokens += 1
        spec.after_verify(sched, LaunchedStep(sched, [0], [None], verified={0: (n - 1, accepted)}))
        req.num_pending_tokens = 0
        for token in appended:
            req.append_output(token, None)

    req.num_computed_tokens, req.num_pending_tokens = req.num_tokens, 1  # a plain step in flight
    assert not spec.propose_ahead([req]) and req.spec_token_ids == []  # no verify has accepted anything yet
    req.num_computed_tokens, req.num_pending_tokens = req.num_tokens - 1, 0  # drained
    spec.propose([req])
    assert req.spec_token_ids == [9, 1, 6]
    verify(accepted=3, appended=[9, 1, 6, 7])
    spec.next_step()
    req.num_pending_tokens = 1  # the next plain step in flight
    req.num_computed_tokens = req.num_tokens
    assert spec.propose_ahead([req]) and req.spec_token_ids == [9, 1, 6]  # past the guess 8 for the one in flight
    verify(accepted=0, appended=[3, 4])  # the token in flight, then the target's own
    assert spec.backoff["r"][0] == 1
    spec.next_step()
    req.num_pending_tokens = 1
    req.num_computed_tokens = req.num_tokens
    assert not spec.propose_ahead([req])


def test_proposals_on_the_guess_for_the_token_in_flight() -> None:
    """A request the host's lookup expects proposals for (copying or not) gets the lookup's guess for its token in
    flight and the proposals after that guess; one the lookup did not expect gets none."""
    kv = KVCacheManager(BlockPool(16, enable_caching=False), 4, block_hash_fn("fast", 0))
    spec = SpecDecoder(NgramProposer(3, 1, 4), 3, kv)
    copying = Request("a", [5, 6, 7, 8, 9, 1, 6, 7, 8], SamplingParams(max_tokens=30), frozenset(), 64)
    other = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=30), frozenset(), 64)
    for req in (copying, other):
        req.num_computed_tokens, req.num_pending_tokens = req.num_tokens, 1  # a plain step in flight
        req.spec_token_ids = [1]
    assert spec.wants_verify([copying, other]) and spec.expected == {"a"}
    assert spec.propose_on_guess([copying, other]) == {"a": 9}
    assert copying.spec_token_ids == [1, 6, 7] and other.spec_token_ids == []
    last = Request("c", copying.prompt_token_ids, SamplingParams(max_tokens=1), frozenset(), 64)
    last.num_computed_tokens, last.num_pending_tokens = last.num_tokens, 1  # its token in flight is its last
    assert spec.wants_verify([last]) is False and spec.propose_on_guess([last]) == {}


def test_a_drain_whose_complete_lookup_finds_nothing_backs_off() -> None:
    """With a step in flight, the lookup on the host's tokens (the one in flight aside) decides whether to drain
    for a verify; when the lookup on the complete context then proposes nothing, that counts as a miss, so
    free-form text stops draining its overlapped steps for lookups that keep failing."""
    kv = KVCacheManager(BlockPool(16, enable_caching=False), 4, block_hash_fn("fast", 0))
    spec = SpecDecoder(NgramProposer(3, 2, 4), 3, kv)
    req = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=30), frozenset(), 64)
    req.num_computed_tokens, req.num_pending_tokens = req.num_tokens, 1  # a plain step in flight
    spec.next_step()
    for misses, landed in ((1, 9), (2, 8)):
        assert spec.wants_verify([req])  # the suffix "1 2" occurred before
        req.append_output(landed, None)  # the token in flight lands: "2 <landed>" never occurred
        req.num_computed_tokens, req.num_pending_tokens = req.num_tokens - 1, 0  # drained
        spec.propose([req])
        assert req.spec_token_ids == [] and spec.backoff["r"] == (misses, spec.step + 2 ** misses)
        for token in (1, 2):  # plain steps bring "1 2" back at the end: the lookup would drain again
            req.append_output(token, None)
        req.num_computed_tokens, req.num_pending_tokens = req.num_tokens, 1
        spec.next_step()
        while spec.backoff["r"][1] > spec.step:  # sitting out: no drain
            assert not spec.wants_verify([req])
            spec.next_step()
    assert spec.wants_verify([req])
    req.num_computed_tokens, req.num_pending_tokens = req.num_tokens - 1, 0  # drained with "1 2" as the suffix
    spec.propose([req])
    assert req.spec_token_ids and spec.backoff["r"][0] == 2  # a proposal to verify: no miss counted


def test_short_proposals_are_filled_up_to_k_for_full_verify_graphs() -> None:
    kv = KVCacheManager(BlockPool(16, enable_caching=False), 4, block_hash_fn("fast", 0))
    spec = SpecDecoder(NgramProposer(4, 1, 4), 4, kv)
    req = Request("r", [5, 6, 7, 5, 6], SamplingParams(max_tokens=30), frozenset(), 64)
    req.num_computed_tokens = req.num_tokens - 1
    spec.propose([req])
    assert req.spec_token_ids == [7, 5, 6]  # the lookup runs into the end of the context
    spec.pad_proposals = True
    spec.propose([req])
    assert req.spec_token_ids == [7, 5, 6, 6]
    req.max_total_tokens = req.num_tokens + 3  # room for 2 proposals and the target's token
    spec.propose([req])
    assert req.spec_token_ids == [7, 5]


@pytest.mark.parametrize("n_min,n_max", [(1, 4), (2, 4), (3, 3)])
def test_the_growing_index_proposes_what_a_full_scan_does(n_min: int, n_max: int) -> None:
    """One index per request, extended a few tokens at a time (as steps append 1 to k + 1 tokens), gives the
    scan's proposal at every length, on text with many repeats (a small vocabulary)."""
    rng = random.Random(n_min * 10 + n_max)
    tokens: list[int] = []
    index = NgramIndex(n_min, n_max)
    while len(tokens) < 400:
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        k = rng.randint(1, 6)
        assert index.propose(tokens, k) == scan_proposal(tokens, k, n_min, n_max), len(tokens)


def test_trim_frees_emptied_blocks_only() -> None:
    pool = BlockPool(10, enable_caching=False)
    kv = KVCacheManager(pool, 4, block_hash_fn("fast", 0))
    req = Request("r", list(range(9)), SamplingParams(), frozenset(), 64)
    assert kv.allocate(req, 9 + 4)  # 13 positions: 4 blocks
    ids = kv.block_ids_of(req)
    free = pool.num_free
    kv.trim(req, 9)  # positions 0..8: 3 blocks
    assert kv.block_ids_of(req) == ids[:3] and kv.block_ids_of(req) is not ids
    assert pool.num_free == free + 1
    kv.trim(req, 12)  # nothing past the blocks it has
    assert len(kv.block_ids_of(req)) == 3
