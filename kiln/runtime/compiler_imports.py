"""The compiler's imports, on a thread while the model loads.

A warm 8B start imports torch._dynamo, Inductor and sympy inside `Runtime(...)`: ~3.8 s of its main thread on
the H200 (a sampled start, 2026-12-01), paid where the compile phase (or, for sympy, the model's
materialisation) first touches them. None of it needs the model, so the engine starts them on a thread
first thing, beside the weight load, whose main-thread time is mostly waiting on reads and copies with the
GIL released, and joins the thread before the compile phase. Two threads importing that stack at once are not
safe: its modules import each other in cycles, and CPython's deadlock avoidance then hands one thread a module
the other is still initialising (or has just removed after a failure). On the H200 three of eight MoE starts
(2026-12-02) died in the compile phase's `from torch._dynamo.source import ...` with `KeyError:
'torch._dynamo'` while the thread was still importing; the main thread would have waited on the module locks
anyway. An import that fails on the thread fails again, with its traceback, where the main thread imports it.
KILN_COMPILER_PREIMPORT=0 turns it off (the A/B's other arm).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time

import torch

logger = logging.getLogger("kiln")

MODULES = ("sympy", "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch._inductor.standalone_compile",
           "kiln.compiler", "kiln.compiler.cuda_graphs")


def start_compiler_imports(level: int, device: torch.device) -> threading.Thread | None:
    """Import the compiler stack on a daemon thread when this start will compile (level >= 1) on a GPU (on a
    CPU the load is a memory map: nothing for the thread to hide behind)."""
    if level < 1 or device.type != "cuda" or os.environ.get("KILN_COMPILER_PREIMPORT", "1") == "0":
        return None
    thread = threading.Thread(target=_import_all, name="kiln-compiler-imports", daemon=True)
    thread.start()
    return thread


def _import_all() -> None:
    start = time.perf_counter()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the main thread's own import raises it where it matters
            logger.debug("compiler pre-import of %s failed; left to the main thread", name, exc_info=True)
            return
    logger.debug("compiler modules imported on a thread in %.2fs", time.perf_counter() - start)
