"""Inductor's CPU vector-ISA checks that passed, remembered under the cache root (docs/cache.md).

Before its first C++ kernel a process asks Inductor which vector ISAs it may compile for, and Inductor checks each
one the CPU's flags allow (AVX512 VNNI, AVX512, AVX2 on this project's CPU machine) by building a small library
with the ISA's flags and loading it in a child Python: 1.5-1.7 s a process there, about 20% of a warm start of
the embedded model, paid again by every compile worker. The answer changes only with the CPU, the compiler and
torch, so a check that passed is stored as `<cache root>/vec_isa/<fingerprint>.json` (the ISA's flags and code,
hashed) and later processes skip it. Only passes are stored: a failure (a timeout on a loaded host, say) is
checked again, so it can never turn vectorisation off for good. `KILN_VEC_ISA_MEMO=0` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from kiln.cache.store import atomic_write, cache_root, switched_off

VEC_ISA_DIR = "vec_isa"
_memo: Path | None = None  # this process's file, once primed


def cpu_flags() -> str:
    """The first CPU's feature flags (Linux), or the processor's name elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def vec_isa_fingerprint() -> str:
    """A digest of what a check's outcome depends on: torch, the Python that loads, the CPU, the C++ compiler."""
    import torch._inductor.config as inductor_config

    digest = hashlib.sha256()
    cxx = inductor_config.cpp.cxx  # the compilers Inductor searches, e.g. (None, "g++")
    for name in cxx if isinstance(cxx, (list, tuple)) else (cxx,):
        found = shutil.which(name) if isinstance(name, str) else None
        stat = os.stat(found) if found else None
        digest.update(f"{name}={found}:{stat and (stat.st_size, stat.st_mtime_ns)}\n".encode())
    for part in (torch.__version__, torch.__file__, os.path.realpath(sys.executable), platform.machine(), cpu_flags(),
                 os.environ.get("CXX", ""), os.environ.get("LD_LIBRARY_PATH", "")):
        digest.update(f"{part}\n".encode())
    return digest.hexdigest()[:32]


def check_key(arch_flags: str, code: str) -> str:
    return hashlib.sha256(f"{arch_flags}\n{code}".encode()).hexdigest()[:24]


def _passed(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def remember_checks(path: Path) -> bool:
    """Answer Inductor's ISA checks that `path` records as passed without running them, and record new passes
    there. False where this torch has no such check (nothing replaced)."""
    global _memo
    from torch._inductor import cpu_vec_isa

    base = getattr(cpu_vec_isa, "VecISA", None)
    original = getattr(base, "check_build", None)
    if original is None or _memo is not None:
        return _memo is not None
    passed = _passed(path)

    def check_build(self: Any, code: str) -> bool:
        key = check_key(self.build_arch_flags(), code)
        if key in passed:
            return True
        if not original(self, code):
            return False
        passed.add(key)
        try:  # with any other process's passes since: a concurrent start loses nothing
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(sorted(passed | _passed(path))).encode())
        except OSError:  # a read-only cache only costs the next process the check
            pass
        return True

    base.check_build = check_build  # the base class's; its subclasses call it, none overrides it
    _memo = path
    return True


def prime_vec_isa(root: Path | None = None) -> Path | None:
    """Remember this machine's ISA checks under the cache root; returns the file (None if off or unsupported)."""
    if _memo is not None or switched_off("KILN_VEC_ISA_MEMO"):
        return _memo
    path = (root or cache_root()) / VEC_ISA_DIR / f"{vec_isa_fingerprint()}.json"
    return path if remember_checks(path) else None


def primed() -> Path | None:
    """This process's file if it was primed (for compile workers)."""
    return _memo
