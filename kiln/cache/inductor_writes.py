"""Inductor's cache files are written only when their bytes change.

A warm start loads each artifact through `torch.compiler.load_cache_artifacts`, which writes every entry the
artifact carries (its AOTAutograd and FX-graph entries, an autotune record per Triton kernel) back into
Inductor's cache under the key directory (store.own_caches), where the cold start that compiled it left the
same bytes. Each write is a temp file renamed over the old one. On the H200 host one sampled warm 8B start spent
2.6 s in those renames, four others 0.1 s (2x H200, 2026-12-01): a rename over a file can wait for the
file system to write back what the previous start left, which is the usual order when `kiln serve` follows
`kiln warmup`. So `write_atomic` leaves a file alone when it already holds the bytes to be written: the cache
ends exactly as the write would have left it. Text content (not on the load path) is always written.
`KILN_SKIP_UNCHANGED_WRITES=0` keeps Inductor's own function (an A/B knob).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from kiln.cache.rebind import rebind
from kiln.cache.store import switched_off

_original: Callable[..., None] | None = None  # Inductor's write_atomic, once replaced
skipped = 0  # writes left out in this process (the number a test and a benchmark read)


def holds(path: str | os.PathLike[str], content: bytes) -> bool:
    """Whether the file at `path` holds exactly `content` (the size first, so most misses read nothing)."""
    try:
        if os.stat(path).st_size != len(content):
            return False
        with open(path, "rb") as file:
            return file.read() == content
    except OSError:
        return False


def skip_unchanged_writes() -> None:
    """Replace Inductor's `write_atomic` (wherever it is bound) with one that skips unchanged files; idempotent."""
    global _original
    if _original is not None or switched_off("KILN_SKIP_UNCHANGED_WRITES"):
        return
    from torch._inductor import codecache

    original = codecache.write_atomic

    @functools.wraps(original)
    def write_atomic(path: str, content: str | bytes, *args: Any, **kwargs: Any) -> None:
        global skipped
        if isinstance(content, bytes) and holds(path, content):
            skipped += 1
            return
        original(path, content, *args, **kwargs)

    rebind("write_atomic", original, write_atomic)
    _original = original
