"""Triton's `triton_key()`, remembered under the cache root like Inductor's torch_key (torch_key.py, docs/cache.md).

`triton_key()` is a sha256 over Triton's compiler sources and its whole `libtriton` shared library, memoised per
process. Inductor asks for it when it loads an artifact's Triton kernels (the autotune cache's key) and Triton
when it compiles one; on the H200 host it was 1.4 s of a 10.9 s warm 8B start (a sampled start,
2026-12-01), the largest single item left after torch_key. Triton's function has no setter, so the stored value
replaces the function where Triton and Inductor bind it by name (Triton's own worker pools do the same).

Stored as `<cache root>/triton_key/<fingerprint>.txt`, the fingerprint a stat digest of the triton package's module
files (torch_key.package_fingerprint); compile workers get the parent's value (`primed()`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kiln.cache.rebind import rebind
from kiln.cache.store import cache_root, switched_off
from kiln.cache.torch_key import package_fingerprint, remembered

TRITON_KEY_DIR = "triton_key"
_primed: str | None = None  # this process's value, once primed or set


def triton_fingerprint(root: Path | None = None) -> str:
    import triton

    return package_fingerprint(root or Path(triton.__file__).resolve().parent, triton.__version__)


def set_triton_key(value: str) -> None:
    """Make every binding of Triton's `triton_key` in this process return `value`."""
    global _primed
    import triton.runtime.cache as cache

    def stored_key() -> str:
        return value

    rebind("triton_key", cache.triton_key, stored_key)
    _primed = value


def prime_triton_key(root: Path | None = None) -> str | None:
    """Make `triton_key()` cheap in this process: the stored value for this Triton's files, or compute it once and
    store it. None without Triton, or with KILN_TRITON_KEY_MEMO=0 (Triton's own hash every process: an A/B knob)."""
    global _primed
    if _primed is not None or switched_off("KILN_TRITON_KEY_MEMO"):
        return _primed
    if importlib.util.find_spec("triton") is None:
        return None
    import triton.runtime.cache as cache

    def apply(stored: bytes) -> bool:
        set_triton_key(stored.decode().strip())
        return True

    path = (root or cache_root()) / TRITON_KEY_DIR / f"{triton_fingerprint()}.txt"
    _primed = remembered(path, apply, lambda: cache.triton_key().encode()).decode().strip()
    return _primed


def primed() -> str | None:
    """This process's triton_key if it was primed or set (for compile workers); never computes it."""
    return _primed
