"""Serve first, tune in the background: compiles not needed to serve run after the runtime is ready.

`background_compile_sizes` (resolved: by default -O3's sizes above the capture sizes)
are compiled in a spawned worker process pool, started once the runtime is ready (`start()`, after the
CUDA-graph capture), while the engine serves from the range artifacts; the engine calls `swap_if_done()` at
every step boundary (before a forward is launched, never inside one), and once every compile has finished, the new
artifacts are loaded and installed in all piece runners and the sizes added to the dispatcher, in one go
on the engine's thread. Nothing compiles or loads in the serving thread before that, and a failed
compile only means that size keeps being served from its range.

Rule with CUDA graphs: a graph holds the artifact it was captured with, so the graphs at a swapped size are
captured again right after the swap (`on_swap`, set by kiln/compiler/cuda_graphs.py; the device is
synchronised first, so the step in flight finishes with the graphs it was launched with). So any size may
be a background size: an 8B cold start reached its first token 7-9 s sooner with issue 14's exact sizes here
than with them up front (docs/compiler.md).

Where every artifact is already in the compile cache (a warm start), nothing is left to do in the
background: the constructor reads them and `install_compiler` swaps them in before any graph is captured,
so a warm start serves with the exact sizes from its first step and never re-captures. Those the cache lacks
(the start that filled it ended before they were done) compile in the background as on a cold start: a
captured graph loaded from the cache keeps the token count's symbol and the pieces' input layouts for them.

A process that ends before the compiles do must not wait for them: `cancel()` (from `Engine.shutdown()`, and
at interpreter exit for a runtime never shut down) drops the compiles not started and terminates the workers
running the others; nothing is swapped in afterwards and the sizes stay on their ranges. (With concurrent.futures'
process pool, a one-prompt script waited at exit for every running compile, ~13 s on an 8B model; kiln's pool,
kiln/compiler/process_pool.py, keeps nothing that exit would wait for, and the cancel at exit ends its worker
processes rather than leaving them compiling for no one.)
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from kiln.compiler.parallel import CompileJob, CompilePool, default_workers
from kiln.compiler.ranges import CompileKey

logger = logging.getLogger("kiln.compiler")

CANCEL_JOIN_SECONDS = 10.0  # the background thread ends at once after a cancel; this only bounds a surprise


class BackgroundCompiles:
    def __init__(self, compiled: Any, sizes: tuple[int, ...], workers: int | None = None) -> None:
        backend = compiled.backend
        self.compiled = compiled
        self.stats = compiled.stats
        self.dispatcher = backend.dispatcher
        capture = compiled.capture
        self.runners = capture.runners
        keys = [CompileKey.size(s) for s in sizes if s not in self.dispatcher.sizes]
        self.jobs = [CompileJob(piece_hash, group[0].module, key, capture.piece_specs.get(piece_hash))
                     for piece_hash, group in capture.split.distinct().items() for key in keys]
        self.sizes = tuple(k.lo for k in keys)
        self.stats.background_pending = len(self.jobs)
        # called with the swapped sizes right after a swap (CUDA graphs re-capture them)
        self.on_swap: Callable[[tuple[int, ...]], None] | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._symbol = capture.symbol
        # a warm start finds them in the compile cache: only bytes are read, here, before any graph exists
        self._results: list[tuple[CompileJob, bytes, bool]] = []  # (job, artifact, to save in the cache)
        cached = getattr(backend.compiler.store, "load_payload", None)
        todo = []
        for job in self.jobs:
            payload = cached(job.piece_hash, job.key) if cached is not None else None
            if payload is not None:
                self._results.append((job, payload, False))
            else:
                todo.append(job)
        self._todo = todo
        self._workers = workers
        self._thread: threading.Thread | None = None
        self._pool: CompilePool | None = None
        self._cancelled = False
        self._lock = threading.Lock()  # a swap (engine thread) and a cancel (any thread, e.g. at exit)
        if not todo:
            self._done.set()

    def start(self) -> None:
        """Start compiling what the cache did not have, once the runtime is ready: the worker processes would
        otherwise take the cores the CUDA-graph capture needs (an 8B cold start's capture went 2.1 -> 6.2 s
        on an H200 host when they ran beside it)."""
        with self._lock:
            if self._done.is_set() or self._thread is not None or self._cancelled:
                return
            self._start(self._todo)

    def _start(self, todo: list[CompileJob]) -> None:
        # always worker processes (at least one): an Inductor compile on a second thread of the serving
        # process would share Dynamo's and Inductor's global state with the forwards
        self._pool = CompilePool(self.compiled.backend.compiler, self._symbol,
                                 self._workers or default_workers(len(todo)) or 1)
        for job in todo:  # pickle the pieces here, not on the background thread
            self._pool.prepare(job)
        self._thread = threading.Thread(target=self._run, args=(todo,), name="kiln-background-compile", daemon=True)
        self._thread.start()
        _cancel_at_exit(self)

    def _run(self, todo: list[CompileJob]) -> None:
        start = time.perf_counter()
        try:
            for job, payload in self._pool.compile_payloads(todo):
                if payload is not None:
                    self._results.append((job, payload, True))
        except Exception as exc:  # noqa: BLE001 - serving goes on from the ranges
            if not self._cancelled:
                logger.warning("background compiles failed (%s); those sizes stay served by their ranges", exc)
        finally:
            self._pool.shutdown()  # a no-op once terminated
            self.seconds = time.perf_counter() - start
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the background compiles for good (idempotent, never raises): the ones not started are dropped,
        the worker processes running the others are terminated, the background thread ends; nothing is
        swapped in afterwards (those sizes stay served by their ranges). Artifacts already swapped in stay.
        `stats.background_cancelled` counts the artifacts that were pending."""
        try:
            with self._lock:
                if self._cancelled:
                    return
                self._cancelled = True
                pool, thread = self._pool, self._thread
            if pool is not None:
                pool.terminate()
            if thread is not None and thread is not threading.current_thread():
                thread.join(CANCEL_JOIN_SECONDS)
            with self._lock:
                cancelled = self.stats.background_pending
                self.stats.background_cancelled += cancelled
                self.stats.background_pending = 0
                self._results.clear()
                self._done.set()
            if cancelled:
                logger.info("background compiles cancelled: %d artifact(s) not swapped in (sizes %s stay on their "
                            "ranges)", cancelled, self.sizes)
        except Exception as exc:  # noqa: BLE001 - a shutdown or an exit must go on
            logger.warning("cancelling the background compiles failed (%s)", exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every background compile has finished (not yet swapped in); for tests, benchmarks."""
        self.start()
        return self._done.wait(timeout)

    def swap_if_done(self) -> bool:
        """At a step boundary: install the finished artifacts (all at once); True if a swap happened now."""
        if not self._done.is_set() or self.stats.background_pending == 0:
            return False
        with self._lock:
            if self._cancelled or self.stats.background_pending == 0:
                return False
            return self._swap()

    def _swap(self) -> bool:
        start = time.perf_counter()
        compiler = self.compiled.backend.compiler
        loaded: dict[tuple[str, CompileKey], Any] = {}
        for job, payload, save in self._results:
            try:
                loaded[(job.piece_hash, job.key)] = compiler.adopt(job.gm, job.key, job.piece_hash, payload, save)
                self.stats.cache_hits += not save  # read from the compile cache, not compiled
            except Exception as exc:  # noqa: BLE001 - that size stays on its range
                logger.warning("background artifact %s at %s did not load (%s)", job.piece_hash[:12], job.key, exc)
        # a size is swapped in only if every distinct piece has it: dispatch is per token count, shared
        hashes = {j.piece_hash for j in self.jobs}
        sizes = [s for s in self.sizes if all((h, CompileKey.size(s)) in loaded for h in hashes)]
        for runner in self.runners.values():
            for s in sizes:
                runner.compiled[CompileKey.size(s)] = loaded[(runner.piece_hash, CompileKey.size(s))]
        self.dispatcher.add_sizes(sizes)
        for runner in self.runners.values():
            runner.reset_dispatch()
        self.stats.background_swapped = len(sizes) * len(hashes)
        self.stats.background_failed = len(self.jobs) - self.stats.background_swapped
        self.stats.background_pending = 0
        self._results.clear()
        if sizes and self.on_swap is not None:
            self.on_swap(tuple(sizes))
        self.stats.background_swap_seconds = time.perf_counter() - start
        # a failure leaves its size on the range: worth a warning (the workers' own errors are on stderr)
        logger.log(logging.WARNING if self.stats.background_failed else logging.INFO,
                   "background compiles swapped in: exact sizes %s (%d artifacts, %d failed) after %.1f s; the "
                   "swap took %.2f s", sizes, self.stats.background_swapped, self.stats.background_failed,
                   self.seconds, self.stats.background_swap_seconds)
        return True


def _cancel_at_exit(background: BackgroundCompiles) -> None:
    """Cancel at interpreter exit unless cancelled before, holding the object weakly (it may be long gone)."""
    ref = weakref.ref(background)

    def cancel() -> None:
        target = ref()
        if target is not None:
            target.cancel()

    atexit.register(cancel)
