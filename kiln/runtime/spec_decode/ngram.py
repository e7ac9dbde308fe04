"""N-gram ("prompt lookup") proposals: the tokens that followed the context's last n tokens where those first
occurred earlier in the context. Free to compute on the host, and right whenever the output copies its
input (rewrites, repetitions, code edits).

Each request keeps an index of the first occurrence of every n-gram in its tokens, extended by the tokens
added since the last lookup, so a lookup costs a few dictionary probes whatever the context's length. A scan
of the whole context per step (numpy windows) cost 70 us at 200 tokens and 450 us at 4,000 on the CPU, per
request and step, and made a small model's overlapped steps host-bound on the H200 (docs/spec_decode.md). The
index holds ~375 B of host memory per context token (lookup 2..4).
"""

from __future__ import annotations

from kiln.runtime.request import Request


class NgramIndex:
    """First occurrence of each n-gram (n_min <= n <= n_max) of a growing token list that some token follows."""

    def __init__(self, n_min: int, n_max: int) -> None:
        # longest first: a lookup takes the first size that matches
        self.first: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_max, n_min - 1, -1)}
        self.indexed = 0  # the list's length at the last `extend`

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams the tokens appended since the last call made followed (tokens only ever grow)."""
        length = len(tokens)
        for n, first in self.first.items():
            # n-grams starting at 0..length-1-n have a next token; those up to indexed-1-n are in already
            for start in range(max(self.indexed - n, 0), length - n):
                first.setdefault(tuple(tokens[start:start + n]), start)
        self.indexed = length

    def propose(self, tokens: list[int], k: int, skip: int = 0) -> list[int]:
        """Up to k tokens following the earliest earlier occurrence of the longest suffix of n_max..n_min tokens,
        after the first `skip` of them (the guesses for tokens still in flight)."""
        self.extend(tokens)
        length = len(tokens)
        for n, first in self.first.items():
            if n > length - 1:
                continue
            start = first.get(tuple(tokens[length - n:]))
            if start is not None:  # never the suffix itself: its n-gram has no next token yet, so is not indexed
                return tokens[start + n + skip:start + n + skip + k]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, tuple[Request, NgramIndex]] = {}

    def propose(self, reqs: list[Request], limits: list[int], skip: int = 0) -> list[list[int]]:
        """Each request's proposals from its tokens on the host; `skip`: that many of its next tokens are in
        flight, so the proposals start after the lookup's guesses for them."""
        out = []
        for req, limit in zip(reqs, limits):
            entry = self._indexes.get(req.request_id)
            if entry is None or entry[0] is not req:  # a new request (ids can be reused once one finishes)
                entry = self._indexes[req.request_id] = (req, NgramIndex(self.n_min, self.n_max))
            out.append(entry[1].propose(req.token_ids, min(self.k, limit), skip))
        return out

    def release(self, live: set[str]) -> None:
        """Drop the indexes of requests no longer running."""
        if len(self._indexes) > len(live):
            self._indexes = {r: e for r, e in self._indexes.items() if r in live}
