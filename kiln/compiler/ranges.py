"""Token-count ranges and exact sizes, and the dispatch from a step's token count to one of them.

Every compiled piece has one artifact per `CompileKey`. A key is either an exact size (static shapes,
Inductor may specialise everything) or an inclusive range (the token dim stays symbolic). Dispatch
prefers an exact size, then the range that contains the count; there is no silent fallback, because
running outside every compiled range would mean compiling while serving.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class CompileKey:
    lo: int
    hi: int
    exact: bool  # an exact size compiled with static shapes (lo == hi)

    @classmethod
    def size(cls, n: int) -> CompileKey:
        return cls(n, n, True)

    @classmethod
    def range(cls, lo: int, hi: int) -> CompileKey:
        if not 1 <= lo <= hi:
            raise ValueError(f"a compile range needs 1 <= lo <= hi, got [{lo}, {hi}]")
        return cls(lo, hi, False)

    def contains(self, n: int) -> bool:
        return self.lo <= n <= self.hi

    def __str__(self) -> str:  # used in file names and stats, so keep it path-safe
        return f"size_{self.lo}" if self.exact else f"range_{self.lo}_{self.hi}"


class TokenCountError(ValueError):
    """A forward with a token count that no compiled graph covers."""


def build_ranges(max_num_tokens: int, split_points: Iterable[int] = ()) -> list[CompileKey]:
    """[1, max] cut after each split point: points (16, 64) -> [1, 16], [17, 64], [65, max]."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    points = sorted({int(p) for p in split_points if 1 <= int(p) < max_num_tokens})
    ranges, lo = [], 1
    for p in points + [max_num_tokens]:
        ranges.append(CompileKey.range(lo, p))
        lo = p + 1
    return ranges


class Dispatcher:
    """token count -> CompileKey: exact size first, then the containing range, else a clear error."""

    def __init__(self, ranges: list[CompileKey], sizes: Iterable[int] = ()) -> None:
        if not ranges:
            raise ValueError("at least one compile range is needed")
        self.ranges = sorted(ranges)
        self.sizes = tuple(sorted({int(s) for s in sizes}))
        self.max_num_tokens = self.ranges[-1].hi
        outside = [s for s in self.sizes if not any(r.contains(s) for r in self.ranges)]
        if outside:
            raise ValueError(f"compile sizes {outside} lie outside every compile range {self.describe()}")
        self._memo: dict[int, CompileKey] = {}

    @property
    def keys(self) -> list[CompileKey]:
        """Everything to compile: ranges first (the general graphs), then exact sizes."""
        return self.ranges + [CompileKey.size(s) for s in self.sizes]

    def add_sizes(self, sizes: Iterable[int]) -> None:
        """More exact sizes (background compiles, swapped in at a step boundary); forgets memoised choices."""
        new = {int(s) for s in sizes}
        outside = [s for s in new if not any(r.contains(s) for r in self.ranges)]
        if outside:
            raise ValueError(f"compile sizes {sorted(outside)} lie outside every compile range {self.describe()}")
        self.sizes = tuple(sorted(set(self.sizes) | new))
        self._memo.clear()

    def describe(self) -> str:
        ranges = ", ".join(f"[{r.lo}, {r.hi}]" for r in self.ranges)
        return f"ranges {ranges}; exact sizes {list(self.sizes)}"

    def select(self, num_tokens: int) -> CompileKey:
        key = self._memo.get(num_tokens)
        if key is not None:
            return key
        if num_tokens in self.sizes:
            key = CompileKey.size(num_tokens)
        else:
            key = next((r for r in self.ranges if r.contains(num_tokens)), None)
        if key is None:
            raise TokenCountError(
                f"no compiled graph covers a forward of {num_tokens} tokens ({self.describe()}); "
                f"the scheduler's token budget (max_num_batched_tokens={self.max_num_tokens}) must keep "
                "every step inside the compiled ranges"
            )
        self._memo[num_tokens] = key
        return key
