"""EngineLoop: the thread that owns the Engine and steps it, fed by a thread-safe inbox of commands.

Only this thread touches the Engine, its scheduler and its tokenizer (HF fast tokenizers are not safe to
share between threads), so the engine needs no locks. Results go back to the event loop through
`loop.call_soon_threadsafe`: one call per step carrying every request's output.

A failing `Engine.step()` fails only the requests that were in that batch (they are aborted, so their KV
blocks are freed) and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.entrypoints.server.logprobs import TokenTexts
from kiln.entrypoints.server.request_stream import (
    EngineStepError,
    EngineUnavailableError,
    InvalidPromptError,
    RequestAborted,
    RequestStream,
)
from kiln.runtime.distributed import EngineDeadError
from kiln.runtime.outputs import RequestOutput

if TYPE_CHECKING:
    from kiln.entrypoints.server.metrics import ServerMetrics
    from kiln.runtime.engine import Engine

logger = logging.getLogger("kiln.server")
Batch = list[tuple[RequestStream, RequestOutput | BaseException]]


@dataclass
class Add:
    stream: RequestStream


@dataclass
class Abort:
    request_id: str


@dataclass
class Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]


class Stop:
    pass


Command = Add | Abort | Call | Stop


class EngineLoop:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, deliver: Callable[[Batch], None],
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.num_step_failures = 0
        self.dead: BaseException | None = None
        self._loop = loop
        self._deliver = deliver  # runs on the event loop
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending_lock = threading.Lock()
        self._pending_adds = 0
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # requests inside the engine
        self._token_texts = TokenTexts(engine.tokenizer)
        self.thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    @property
    def pending_adds(self) -> int:
        """Requests sent but not yet handed to the engine (they count as waiting)."""
        return self._pending_adds

    def send(self, command: Command) -> None:
        """Thread-safe; the command runs before the next step."""
        if isinstance(command, Add):
            with self._pending_lock:
                self._pending_adds += 1
        self._inbox.put(command)
        self._wake.set()

    # -- bridging back to the event loop -----------------------------------------------------------------
    def _post(self, batch: Batch) -> None:
        if batch:
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _resolve(self, future: asyncio.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():  # cancelled: the client went away while it waited
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    # -- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self._stopping:
                    break
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # a bug in this loop itself: report it, fail everyone, stay visible
            self.dead = exc
            logger.exception("the engine loop died")
        finally:
            self._fail_everything()
            shutdown = getattr(self.engine, "shutdown", None)  # stops tensor-parallel workers, if any
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:
                    logger.exception("engine shutdown failed")

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                self._admit(command.stream)
            elif isinstance(command, Abort):
                self._abort(command.request_id, RequestAborted(command.request_id), "abort")
            elif isinstance(command, Call):
                try:
                    self._resolve(command.future, result=command.fn())
                except Exception as exc:
                    self._resolve(command.future, error=exc)
            else:
                self._stopping = True

    def _admit(self, stream: RequestStream) -> None:
        try:
            try:
                prompt = stream.prompt_source
                if callable(prompt):
                    prompt = prompt()
                params = stream.params_source
                if callable(params):
                    ids = self.engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
                    params = params(ids)
            except ValueError:
                raise
            except Exception as exc:  # e.g. jinja's TemplateError from a chat template: the request's fault
                raise InvalidPromptError(str(exc)) from exc
            self.engine.add_request(prompt, params, stream.request_id, arrival_time=stream.arrival)
        except Exception as exc:
            self._no_longer_pending()
            self._resolve(stream.accepted, error=exc)
        else:
            self._no_longer_pending()
            stream.params = params
            self._streams[stream.request_id] = stream
            self._resolve(stream.accepted, result=params)

    def _no_longer_pending(self) -> None:
        """Before the caller learns the outcome: a caller that adds its next prompt at once must not find this one
        counted twice, pending and in the scheduler's queue (a 2-prompt request was refused at --max-queue 2)."""
        with self._pending_lock:
            self._pending_adds -= 1

    def _abort(self, request_id: str, error: BaseException, reason: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished (or rejected) before the abort arrived
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)
        if self.metrics is not None:
            self.metrics.observe_finished([reason], time.time() - stream.arrival)
        self._post([(stream, error)])

    def _step(self) -> None:
        steps_before = self.engine.stats.steps
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # nothing can run any more: the loop dies, in-flight requests fail, new ones get 503
        except Exception as exc:
            self._on_step_failure(exc)
            return
        if not outputs and self.engine.stats.steps == steps_before:
            # Nothing was schedulable; wait for a command instead of spinning on an empty schedule.
            self._wake.wait(0.005)
            self._wake.clear()
            return
        now = time.time()
        batch: Batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream.params is not None and (stream.params.logprobs is not None
                                              or stream.params.prompt_logprobs is not None):
                self._token_texts.fill(out)
            self._observe(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        self._post(batch)

    def _on_step_failure(self, exc: Exception) -> None:
        """Fail the requests of the failed batch (the running ones; else the one being admitted)."""
        self.num_step_failures += 1
        logger.error("engine step failed; failing the requests in that batch", exc_info=exc)
        scheduler = self.engine.scheduler
        ids = {req.parent_id for req in list(scheduler.running)}
        if not ids and scheduler.waiting:
            ids = {scheduler.waiting[0].parent_id}
        if not ids:
            ids = set(self._streams)
        error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        for request_id in ids:
            if request_id in self._streams:
                self._abort(request_id, error, "error")
            else:
                self.engine.abort(request_id)

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        if any(c.delta_token_ids for c in out.outputs):
            if stream.last_token_time is None:
                self.metrics.observe_ttft(now - stream.arrival)
            else:
                self.metrics.observe_inter_token(now - stream.last_token_time)
            stream.last_token_time = now
        if out.finished:
            self.metrics.observe_finished([c.finish_reason or "abort" for c in out.outputs], now - stream.arrival)

    def _fail_everything(self) -> None:
        """On the way out: abort what is left (freeing its blocks) and answer every pending command."""
        if self.dead is None:
            error = EngineUnavailableError("the server is shutting down", "shutting_down")
        else:  # say why: e.g. a tensor-parallel worker died (EngineDeadError names the rank)
            error = EngineUnavailableError(f"the engine stopped: {self.dead}", "engine_dead")
        for request_id in list(self._streams):
            self._abort(request_id, error, "abort")
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                with self._pending_lock:
                    self._pending_adds -= 1
                self._resolve(command.stream.accepted, error=error)
            elif isinstance(command, Call):
                self._resolve(command.future, error=error)
