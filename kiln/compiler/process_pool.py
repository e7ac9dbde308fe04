"""A pool of kiln's worker processes (child_process.py): `submit` gives a Future, `terminate` stops running calls.

concurrent.futures' ProcessPoolExecutor would do, but its workers are multiprocessing children, which import
the user's main script again (child_process.py says why that cannot be), and its `shutdown` never stops a call
that is running. Here each worker process has one thread of this process that feeds it calls from a shared
queue, so `terminate` can kill the processes: the calls they were running fail (the thread's read of the
reply ends), the ones not started are cancelled, and the threads end.

The processes start in `submit`'s first call, on the caller's thread, so they inherit the environment as it is
then (the compile cache points TORCHINDUCTOR_CACHE_DIR elsewhere later); `initializer(*initargs)` then runs
first in each, and if it fails every call that worker takes fails with its exception. The threads are
daemons and the processes exit when their input pipe closes, so nothing here keeps an interpreter from
exiting; a call running at exit finishes in its process, which then exits (callers that must not wait for
that terminate the pool first, kiln/compiler/background.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kiln.compiler.child_process import ChildProcess

TERMINATE_GRACE_SECONDS = 2.0  # after SIGTERM, before SIGKILL
CLOSE_SECONDS = 10.0  # a worker told to stop, between calls, exits at once: this only bounds a surprise


class WorkerPool:
    def __init__(self, workers: int, name: str, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        self.workers = max(1, workers)
        self.name = name
        self._initializer, self._initargs = initializer, initargs
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._processes: list[ChildProcess] = []
        self._threads: list[threading.Thread] = []
        self._stopped = False

    @property
    def processes(self) -> list[ChildProcess]:
        return list(self._processes)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.name}: the pool is shut down")
            if not self._processes:
                self._start()
            future: Future = Future()
            self._queue.put((future, fn, args))
            return future

    def _start(self) -> None:
        for i in range(self.workers):
            process = ChildProcess(f"{self.name}-{i}")
            self._processes.append(process)
            thread = threading.Thread(target=self._serve, args=(process,), name=f"{self.name}-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, process: ChildProcess) -> None:
        failed: BaseException | None = None
        if self._initializer is not None:
            try:
                process.call(self._initializer, *self._initargs)
            except Exception as exc:  # noqa: BLE001 - reported through every call this worker takes
                failed = exc
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            if failed is not None:
                future.set_exception(failed)
                continue
            try:
                future.set_result(process.call(fn, *args))
            except Exception as exc:  # noqa: BLE001 - the caller's to judge (a dead worker fails every call)
                future.set_exception(exc)
        process.close_input()

    def _stop(self) -> list[threading.Thread]:
        """Refuse new calls, cancel the ones not started and tell each thread to end after its current one."""
        with self._lock:
            self._stopped = True
            threads = list(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        return threads

    def shutdown(self) -> None:
        """Wait for the running calls, cancel the others, and let the processes exit. Idempotent."""
        for thread in self._stop():
            thread.join()
        for process in self._processes:
            process.join(CLOSE_SECONDS)
            process.kill()  # only one that did not exit by itself
            process.close()

    def terminate(self) -> None:
        """Stop now: kill the processes (their running calls fail), cancel the calls not started. Idempotent."""
        threads = self._stop()
        for process in self._processes:
            process.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # SIGTERM ignored or delayed (e.g. inside a C extension)
                process.kill()
                process.join(TERMINATE_GRACE_SECONDS)
        for thread in threads:
            thread.join(TERMINATE_GRACE_SECONDS)
        for process in self._processes:
            process.close()
