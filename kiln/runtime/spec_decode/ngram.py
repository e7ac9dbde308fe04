"""N-gram ("prompt lookup") proposals: the tokens that followed the context's last n tokens where those first
occurred earlier in the context. Free to compute on the host, and right whenever the output copies its
input (rewrites, repetitions, code edits)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kiln.runtime.request import Request


def ngram_proposal(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the earliest earlier occurrence of the longest suffix of n_max..n_min tokens."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows start at 0..length-1-n, so the suffix itself is excluded and a next token always exists
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        return [ngram_proposal(np.asarray(req.token_ids, dtype=np.int64), min(self.k, limit), self.n_min, self.n_max)
                for req, limit in zip(reqs, limits)]
