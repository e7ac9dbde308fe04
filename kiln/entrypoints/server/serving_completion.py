"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.entrypoints.server.async_engine import PromptSource, RequestStream
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.logprobs import completion_logprobs, next_offset
from kiln.entrypoints.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from kiln.entrypoints.server.serving_common import (
    SSE_DONE,
    abort_all,
    check_common,
    collect,
    make_params,
    merge_streams,
    new_id,
    sampling_fields,
    sse,
    sse_error,
    submit,
    to_api_error,
    unless_disconnected,
)
from kiln.runtime.outputs import RequestOutput


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[PromptSource]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError.bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    return UsageInfo.of(sum(f.num_prompt_tokens for f in finals), sum(f.num_completion_tokens for f in finals))


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Any) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse

    model = ctx.resolve_model(req.model)
    check_common(req)
    if req.echo:
        raise APIError.bad_request("echo is not supported", "echo")
    if req.suffix:
        raise APIError.bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError.bad_request("best_of must equal n (beam search and best-of are not supported)", "best_of")
    prompts = _prompts(req.prompt)
    fields = sampling_fields(req)
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
    if req.max_tokens is not None:
        params: Any = make_params({**fields, "max_tokens": req.max_tokens})
    else:  # fill the context, like vLLM; validate the rest now so errors don't wait for the engine
        make_params({**fields, "max_tokens": 1})
        params = lambda ids: make_params({**fields, "max_tokens": max(1, ctx.max_model_len - len(ids))})
    request_id = new_id("cmpl")
    created = int(time.time())
    streams = await submit(ctx, request_id, prompts, params)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(ctx, streams, request_id, created, model, req, include_usage)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        finals = await unless_disconnected(raw, collect(streams), lambda: abort_all(ctx, streams))
    except Exception as exc:
        abort_all(ctx, streams)
        raise to_api_error(exc) from exc
    choices = []
    for i, final in enumerate(finals):
        for comp in final.outputs:
            logprobs = completion_logprobs(comp.logprobs or []) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=i * req.n + comp.index, text=comp.text, logprobs=logprobs,
                                            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    response = CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=_usage(finals))
    return JSONResponse(response.model_dump())


async def _stream(ctx: ServerContext, streams: list[RequestStream], request_id: str, created: int, model: str,
                  req: CompletionRequest, include_usage: bool) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput] = []
    try:
        async for i, out in merge_streams(streams):
            for comp in out.outputs:
                index = i * req.n + comp.index
                finish = comp.finish_reason if comp.finished and index not in done else None
                new_logprobs = req.logprobs is not None and bool(comp.delta_logprobs)
                if not (comp.delta_text or finish or new_logprobs):
                    continue  # tokens still held back by the detokenizer (partial UTF-8, possible stop string)
                if finish:
                    done.add(index)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(comp.delta_logprobs or [], offsets.get(index, 0))
                    if logprobs.tokens:
                        offsets[index] = next_offset(logprobs)
                choice = CompletionChoice(index=index, text=comp.delta_text, logprobs=logprobs,
                                          finish_reason=finish, stop_reason=comp.stop_reason if finish else None)
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))
            if out.finished:
                finals.append(out)
        if include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=_usage(finals)))
        yield SSE_DONE
    except Exception as exc:  # engine failure mid-stream: the header is out, so report in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_all(ctx, streams)  # client gone (cancelled) or error: free the KV blocks now
