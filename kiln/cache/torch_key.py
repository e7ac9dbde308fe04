"""Inductor's `torch_key()`, remembered under the cache root so a start does not recompute it (docs/cache.md).

Inductor stamps every compiled artifact with `torch_key()`, a sha256 over the source of every module of the
torch package, memoised per process; loading an artifact checks it, and each compile worker process computes
it again before its first compile. On the H200 host that walk took 2.2-2.9 s of a 13 s warm 8B start
(a sampled start, 2026-11-30): the largest single item of the warm compile phase.

The key changes only when torch's files do, so it is stored as `<cache root>/torch_key/<fingerprint>.bin`,
the fingerprint being a sha256 over torch's version and every module file's relative path, size and mtime
(a stat walk, ~40 ms). A start that finds its fingerprint hands the stored key to Inductor's memo through
its `set` hook (torch 2.11 and 2.13 both have one); otherwise it computes the key once and stores it.
Compile workers get the parent's value (`primed()`) instead of walking torch again. The fingerprint and the
read-or-compute-and-store step (`package_fingerprint`, `remembered`) serve Triton's key too (triton_key.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.cache.store import atomic_write, cache_root, switched_off

logger = logging.getLogger("kiln.cache")

TORCH_KEY_DIR = "torch_key"
# what torch_key's walk reads is Python modules (source and extension); these directories hold none
_SKIP_DIRS = frozenset({"__pycache__", "include", "share", "bin", "lib"})
_MODULE_SUFFIXES = (".py", ".so", ".pyd")

_primed: bytes | None = None  # this process's value, once primed or set


def torch_fingerprint(root: Path | None = None) -> str:
    """A digest of the module files of the torch package at `root` (default: the imported torch)."""
    return package_fingerprint(root or Path(torch.__file__).resolve().parent, torch.__version__)


def package_fingerprint(root: Path, version: str) -> str:
    """A stat digest of a package's module files: version, then each file's relative path, size and mtime."""
    digest = hashlib.sha256(version.encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(_MODULE_SUFFIXES):
                path = os.path.join(dirpath, name)
                stat = os.stat(path)
                digest.update(f"{os.path.relpath(path, root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _memo():
    """Inductor's memoised torch_key, if this torch has the settable kind (None otherwise)."""
    from torch._inductor import codecache

    memo = getattr(codecache, "torch_key", None)
    return memo if memo is not None and hasattr(memo, "set") else None


def set_torch_key(value: bytes) -> bool:
    """Give Inductor this process's torch_key; False where it was computed here already or cannot be set."""
    global _primed
    memo = _memo()
    if memo is None:
        return False
    try:
        memo.set(value)
    except (AssertionError, RuntimeError):  # already memoised (2.11 asserts, 2.13 raises)
        return False
    _primed = value
    return True


def prime_torch_key(root: Path | None = None) -> bytes | None:
    """Make `torch_key()` cheap in this process: the stored value for this torch's files, or compute it once
    and store it. Returns the key (None where this torch's memo cannot be set)."""
    global _primed
    if _primed is not None or _memo() is None or switched_off("KILN_TORCH_KEY_MEMO"):
        return _primed  # KILN_TORCH_KEY_MEMO=0: Inductor's own walk in every process (an A/B knob)
    path = (root or cache_root()) / TORCH_KEY_DIR / f"{torch_fingerprint()}.bin"
    _primed = remembered(path, set_torch_key, lambda: _memo()())
    return _primed


def remembered(path: Path, apply: Callable[[bytes], bool], compute: Callable[[], bytes]) -> bytes:
    """The value stored at `path` if `apply` takes it; otherwise `compute()`, stored there for the next start."""
    try:
        stored = path.read_bytes()
    except OSError:
        stored = b""
    if stored and apply(stored):
        return stored
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, value)
    except OSError as exc:  # a read-only cache only costs the next start the computation
        logger.info("could not store %s: %s", path, exc)
    return value


def primed() -> bytes | None:
    """This process's torch_key if it was primed or set (for compile workers); never computes it."""
    return _primed
