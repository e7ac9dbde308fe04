"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.entrypoints.server.async_engine import PromptSource, RequestStream
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.logprobs import completion_logprobs, echo_logprobs, next_offset, prompt_logprobs
from kiln.entrypoints.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from kiln.entrypoints.server.serving_common import (
    SSE_DONE,
    StreamUsage,
    abort_all,
    check_common,
    check_fits_queue,
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


def _prompts(ctx: ServerContext, req: CompletionRequest) -> list[PromptSource]:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif not prompt:
        raise APIError.bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]
    if req.add_special_tokens:
        return prompts
    tokenizer = ctx.tokenizer  # without the special tokens: encoded here, on the engine thread when it admits them
    return [(lambda text=p: list(tokenizer(text, add_special_tokens=False)["input_ids"])) if isinstance(p, str)
            else p for p in prompts]


def _usage(finals: list[RequestOutput], prompt_only: bool = False) -> UsageInfo:
    completion = 0 if prompt_only else sum(f.num_completion_tokens for f in finals)
    return UsageInfo.of(sum(f.num_prompt_tokens for f in finals), completion)


def _prompt_only(req: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt scored, nothing generated (OpenAI's and vLLM's form of a prompt's
    log-likelihood). The engine runs the prefill with one token to go; that token is left out of the response."""
    return req.echo and req.max_tokens == 0


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Any) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse

    model = ctx.resolve_model(req.model)
    check_common(req)
    if req.suffix:
        raise APIError.bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError.bad_request("best_of must equal n (beam search and best-of are not supported)", "best_of")
    prompts = _prompts(ctx, req)
    check_fits_queue(ctx, len(prompts), req.n)
    fields = sampling_fields(req)
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
        if req.echo:  # the echoed prompt's tokens get logprobs too (the log-likelihood of a text, e.g. lm-eval's)
            fields.setdefault("prompt_logprobs", req.logprobs)
    prompt_only = _prompt_only(req)
    if req.max_tokens is not None:
        params: Any = make_params({**fields, "max_tokens": 1 if prompt_only else req.max_tokens})
    else:  # fill the context, like vLLM; validate the rest now so errors don't wait for the engine
        make_params({**fields, "max_tokens": 1})
        params = lambda ids: make_params({**fields, "max_tokens": max(1, ctx.max_model_len - len(ids))})
    request_id = new_id("cmpl")
    created = int(time.time())
    streams = await submit(ctx, request_id, prompts, params)
    if req.stream:
        body = _stream(ctx, streams, request_id, created, model, req)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        finals = await unless_disconnected(raw, collect(streams), lambda: abort_all(ctx, streams))
    except Exception as exc:
        abort_all(ctx, streams)
        raise to_api_error(exc) from exc
    choices = []
    for i, final in enumerate(finals):
        echo = await _echo(ctx, final) if req.echo else None
        for comp in final.outputs:
            text, positions = ("", []) if prompt_only else (comp.text, comp.logprobs or [])
            choice = _choice(i * req.n + comp.index, text, positions, req, final, echo, opening=True)
            choice.finish_reason, choice.stop_reason = ("length", None) if prompt_only else \
                (comp.finish_reason, comp.stop_reason)
            choices.append(choice)
    response = CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=_usage(finals, prompt_only))
    return JSONResponse(response.model_dump())


async def _echo(ctx: ServerContext, out: RequestOutput) -> tuple[str, str]:
    """(the prompt as text, its first token's text): what `echo` puts before the completion. A token-id prompt is
    decoded, on the engine thread (which owns the tokenizer)."""
    ids, prompt = out.prompt_token_ids, out.prompt
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        return prompt or "", f"token_id:{ids[0]}"
    return await ctx.engine.call(lambda: (prompt if prompt is not None else str(tokenizer.decode(ids)),
                                          str(tokenizer.decode(ids[:1]))))


def _choice(index: int, text: str, positions: list, req: CompletionRequest, out: RequestOutput,
            echo: tuple[str, str] | None, opening: bool, text_offset: int = 0) -> CompletionChoice:
    """A choice's text and logprobs (`positions`, from `text_offset`); its `opening` part (a whole response, or a
    stream's first chunk) also carries the echoed prompt before them and vLLM's prompt_logprobs where asked."""
    logprobs = None
    if echo is not None:
        text = echo[0] + text
        if req.logprobs is not None:
            logprobs = echo_logprobs(echo[1], out.prompt_logprobs or [None], positions)
    elif req.logprobs is not None:
        logprobs = completion_logprobs(positions, text_offset)
    scored = prompt_logprobs(out.prompt_logprobs) if opening and out.prompt_logprobs is not None else None
    return CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=scored)


async def _stream(ctx: ServerContext, streams: list[RequestStream], request_id: str, created: int, model: str,
                  req: CompletionRequest) -> AsyncIterator[str]:
    report = StreamUsage.of(req.stream_options)
    prompt_only = _prompt_only(req)
    offsets: dict[int, int] = {}  # a choice's next text offset; a choice is in it once its first chunk is out
    done: set[int] = set()
    finals: list[RequestOutput] = []
    try:
        async for i, out in merge_streams(streams):
            for comp in out.outputs:
                index = i * req.n + comp.index
                text, positions = ("", []) if prompt_only else (comp.delta_text, comp.delta_logprobs or [])
                finish = ("length" if prompt_only else comp.finish_reason) if comp.finished and index not in done \
                    else None
                new_logprobs = req.logprobs is not None and bool(positions)
                # a choice's first chunk opens with the echoed prompt and the prompt's logprobs, if asked for
                opening = index not in offsets and (req.echo or out.prompt_logprobs is not None)
                if not (text or finish or new_logprobs or opening):
                    continue  # tokens still held back by the detokenizer (partial UTF-8, possible stop string)
                if finish:
                    done.add(index)
                echo = await _echo(ctx, out) if opening and req.echo else None
                choice = _choice(index, text, positions, req, out, echo, opening, offsets.get(index, 0))
                offsets[index] = next_offset(choice.logprobs) if choice.logprobs is not None \
                    and choice.logprobs.tokens else offsets.get(index, 0)
                choice.finish_reason, choice.stop_reason = finish, comp.stop_reason if finish and not prompt_only \
                    else None
                usage = _usage([out], prompt_only) if report.continuous else None  # this prompt's tokens so far
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice],
                                             usage=usage))
            if out.finished:
                finals.append(out)
        if report.final:
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=_usage(finals, prompt_only)))
        yield SSE_DONE
    except Exception as exc:  # engine failure mid-stream: the header is out, so report in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_all(ctx, streams)  # client gone (cancelled) or error: free the KV blocks now
