"""What completions and chat share: request -> SamplingParams, submission with error mapping, SSE framing,
disconnect handling, and merging the streams of a multi-prompt request.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from kiln.entrypoints.server.async_engine import (
    EngineStepError,
    EngineUnavailableError,
    ParamsSource,
    PromptSource,
    RequestAborted,
    RequestStream,
)
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.protocol import StreamOptions, _SamplingRequest
from kiln.entrypoints.server.structured_request import structured_params
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StreamUsage:
    """What a stream reports of its token counts, as vLLM reads stream_options: a last chunk with the request's
    usage (include_usage, true once stream_options is given), and the usage so far on every chunk
    (continuous_usage_stats, with include_usage)."""

    final: bool
    continuous: bool

    @classmethod
    def of(cls, options: StreamOptions | None) -> StreamUsage:
        if options is None:
            return cls(False, False)
        return cls(options.include_usage, options.include_usage and options.continuous_usage_stats)


def check_fits_queue(ctx: ServerContext, num_prompts: int, n: int) -> None:
    """A request of more sequences than the waiting queue holds (--max-queue) could never be queued: a 400, not
    the 503 that tells a client to retry."""
    limit = ctx.engine.max_queue
    if limit is not None and num_prompts * n > limit:
        raise APIError.bad_request(f"{num_prompts} prompt(s) x n={n} are {num_prompts * n} sequences, more than the "
                                   f"server queues at once ({limit}, --max-queue)",
                                   "n" if num_prompts == 1 else "prompt")


def check_common(req: _SamplingRequest) -> None:
    """Reject what kiln would otherwise silently ignore while changing the answer."""
    if req.use_beam_search:
        raise APIError.bad_request("beam search is not supported", "use_beam_search")
    if req.stream_options is not None and not req.stream:
        raise APIError.bad_request("stream_options can only be set when stream is true", "stream_options")
    if req.n < 1:
        raise APIError.bad_request(f"n must be >= 1, got {req.n}", "n")


def sampling_fields(req: _SamplingRequest) -> dict[str, Any]:
    """The request's sampling fields that were given; unset ones keep SamplingParams' defaults."""
    fields: dict[str, Any] = {"n": req.n, "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output,
                              "skip_special_tokens": req.skip_special_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "cache_salt", "prompt_logprobs", "allowed_token_ids",
                 "truncate_prompt_tokens", "bad_words"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.stop is not None:
        fields["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.stop_token_ids:
        fields["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.logit_bias:
        fields["logit_bias"] = logit_bias(req.logit_bias)
    structured = structured_params(req.response_format, req.structured_outputs, req.model_extra or {})
    if structured is not None:
        fields["structured_outputs"] = structured
    return fields


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {id: bias}, each bias clamped to [-100, 100] as vLLM
    does; a key that is not an integer or a bias that is not finite is a 400."""
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError.bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not math.isfinite(value):
            raise APIError.bad_request(f"logit_bias values must be finite, got {value} for {key!r}", "logit_bias")
        out[token] = min(100.0, max(-100.0, value))
    return out


def make_params(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams.from_dict(fields)
    except (ValueError, TypeError) as exc:
        raise APIError.bad_request(str(exc)) from exc


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return APIError.unavailable(str(exc), exc.code)
    if isinstance(exc, EngineStepError):
        return APIError.internal(str(exc))
    if isinstance(exc, RequestAborted):
        return APIError.unavailable("the request was aborted", "aborted")
    if isinstance(exc, ValueError):
        return APIError.bad_request(str(exc))
    return APIError(500, f"{type(exc).__name__}: {exc}", type_="internal_server_error")


async def submit(ctx: ServerContext, request_id: str, prompts: list[PromptSource],
                 params: ParamsSource) -> list[RequestStream]:
    """Add one engine request per prompt; if any is rejected, abort the ones already added."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request(rid, prompt, params))
    except BaseException as exc:
        for stream in streams:
            ctx.engine.abort(stream.request_id)
        if isinstance(exc, Exception):
            raise to_api_error(exc) from exc
        raise
    return streams


def abort_all(ctx: ServerContext, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            ctx.engine.abort(stream.request_id)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive; the first error ends the merge."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    return [f for f in finals if f is not None]


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw: Any, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await work, but if the client hangs up first, cancel it and call on_disconnect (frees the KV blocks).

    Needed for non-streaming requests: the server does not notice a closed socket until it writes.
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_for_disconnect(raw.receive))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        on_disconnect()
        raise
    finally:
        watch.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    on_disconnect()
    # nobody reads this answer; a plain error keeps uvicorn from logging a crashed handler
    raise APIError(499, "client disconnected", code="client_closed_request")


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the 200 header went out: OpenAI clients raise on an `error` event."""
    return sse(to_api_error(exc).body())
