"""AsyncEngine: the asyncio face of the engine, whose steps run on their own thread (EngineLoop).

A step is a blocking forward pass (milliseconds to seconds), so it must never run on the event loop.
Handlers add, abort and query requests here; each call becomes a command for the engine thread, and
outputs come back into per-request queues (RequestStream).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kiln.entrypoints.server.engine_loop import Abort, Add, Batch, Call, EngineLoop, Stop
from kiln.entrypoints.server.request_stream import (
    EngineStepError,
    EngineUnavailableError,
    InvalidPromptError,
    ParamsSource,
    PromptSource,
    RequestAborted,
    RequestStream,
    merge_outputs,
)

if TYPE_CHECKING:
    from kiln.entrypoints.server.metrics import ServerMetrics
    from kiln.runtime.engine import Engine

T = TypeVar("T")
# re-exported: callers meet these through the engine that raises them
__all__ = ["AsyncEngine", "EngineStepError", "EngineUnavailableError", "InvalidPromptError", "ParamsSource",
           "PromptSource", "RequestAborted", "RequestStream", "merge_outputs"]


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queue: int | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._accepting = True
        self._loop_thread: EngineLoop | None = None
        self._active: dict[str, RequestStream] = {}  # not yet finished, as this side knows it

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will serve requests."""
        self._loop_thread = EngineLoop(self.engine, asyncio.get_running_loop(), self._deliver, self.metrics)
        self._loop_thread.thread.start()

    @property
    def is_healthy(self) -> bool:
        worker = self._loop_thread
        return worker is not None and worker.thread.is_alive() and worker.dead is None

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def num_step_failures(self) -> int:
        return self._loop_thread.num_step_failures if self._loop_thread is not None else 0

    @property
    def num_waiting(self) -> int:
        pending = self._loop_thread.pending_adds if self._loop_thread is not None else 0
        return len(self.engine.scheduler.waiting) + pending

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def stop_accepting(self) -> None:
        """New requests get 503 from now on; in-flight ones continue (safe to call from a signal handler)."""
        self._accepting = False

    def _worker(self) -> EngineLoop:
        if not self.is_healthy:
            raise EngineUnavailableError("the engine is not running", "engine_dead")
        if not self._accepting:
            raise EngineUnavailableError("the server is shutting down", "shutting_down")
        assert self._loop_thread is not None
        return self._loop_thread

    async def add_request(self, request_id: str, prompt: PromptSource, params: ParamsSource) -> RequestStream:
        """Queue a request; returns once the engine has accepted it, raising what rejected it otherwise."""
        worker = self._worker()
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise EngineUnavailableError(f"too many requests waiting (limit {self.max_queue}); retry later",
                                         "queue_full")
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, prompt, params)
        self._active[request_id] = stream
        worker.send(Add(stream))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left before the engine took it
            raise
        except BaseException:
            self._active.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort if still running (idempotent); its blocks are freed before the next step."""
        if self._active.pop(request_id, None) is not None and self._loop_thread is not None:
            self._loop_thread.send(Abort(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps (for anything that touches the tokenizer)."""
        worker = self._worker()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        worker.send(Call(fn, future))
        return await future

    async def drain(self, timeout: float) -> None:
        """Stop accepting, let in-flight requests finish for up to timeout seconds, then abort the rest."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._active):
            self.abort(request_id)

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.stop_accepting()
        if self._loop_thread is not None:
            self._loop_thread.send(Stop())
            await asyncio.to_thread(self._loop_thread.thread.join, timeout)

    def _deliver(self, batch: Batch) -> None:
        """On the event loop: hand each output to its stream; finished ones stop being active."""
        for stream, item in batch:
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                self._active.pop(stream.request_id, None)
