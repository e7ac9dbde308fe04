"""The event-loop side of one request (RequestStream) and the ways a request can end other than finishing.

Outputs arrive from the engine thread in order; a reader that falls behind gets the queued ones merged into
one output whose deltas cover them all, so a slow client costs one SSE event per read, not one per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

# A prompt may be built on the engine thread (chat templates need the tokenizer), and the sampling
# params may depend on the prompt's length (chat's default max_tokens fills the context).
PromptSource = str | list[int] | Callable[[], list[int]]
ParamsSource = SamplingParams | Callable[[list[int]], SamplingParams]


class EngineUnavailableError(Exception):
    """The request was not taken: queue full, shutting down, or the engine loop died (HTTP 503)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineStepError(RuntimeError):
    """Engine.step() raised while this request was in the batch (HTTP 500 for this request only)."""


class RequestAborted(Exception):
    """The request was aborted (client gone, or the server shut down before it finished)."""


class InvalidPromptError(ValueError):
    """Building the prompt or its sampling params failed (e.g. a chat template rejected the messages)."""


def merge_outputs(items: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive outputs of one request into one whose deltas cover them all (the last one's state)."""
    if len(items) == 1:
        return items[0]
    last = items[-1]
    merged = []
    for i, comp in enumerate(last.outputs):
        parts = [o.outputs[i] for o in items]
        logprobs = None
        if any(p.delta_logprobs is not None for p in parts):
            logprobs = [lp for p in parts for lp in (p.delta_logprobs or [])]
        merged.append(dataclasses.replace(
            comp, delta_text="".join(p.delta_text for p in parts),
            delta_token_ids=[t for p in parts for t in p.delta_token_ids], delta_logprobs=logprobs))
    return dataclasses.replace(last, outputs=merged)


class RequestStream:
    """The event-loop side of one request; iterate it for outputs (consecutive ones are merged)."""

    def __init__(self, request_id: str, prompt: PromptSource, params: ParamsSource) -> None:
        self.request_id = request_id
        self.prompt_source = prompt
        self.params_source = params
        self.arrival = time.time()
        self.accepted: asyncio.Future[SamplingParams] = asyncio.get_running_loop().create_future()
        # a client that left before acceptance never awaits this; don't let asyncio warn about it
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None
        # engine-thread bookkeeping for the latency metrics
        self.params: SamplingParams | None = None
        self.last_token_time: float | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> RequestOutput:
        if self._error is not None:
            raise self._error
        items = [await self._queue.get()]
        while not self._queue.empty():  # a slow reader catches up in one go instead of one event per step
            items.append(self._queue.get_nowait())
        outputs: list[RequestOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                self._error = item
                break
            outputs.append(item)
        if not outputs:
            assert self._error is not None
            raise self._error
        merged = merge_outputs(outputs)
        if merged.finished:
            self.finished = True
        return merged

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next()
        if self._error is not None:  # outputs came first; the error still ends the iteration loudly
            raise self._error
