"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one engine request (n choices)."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.entrypoints.server.async_engine import RequestStream
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.logprobs import chat_logprobs, prompt_logprobs
from kiln.entrypoints.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    UsageInfo,
)
from kiln.entrypoints.server.serving_common import (
    SSE_DONE,
    StreamUsage,
    abort_all,
    check_common,
    check_fits_queue,
    collect,
    make_params,
    new_id,
    sampling_fields,
    sse,
    sse_error,
    submit,
    to_api_error,
    unless_disconnected,
)
from kiln.entrypoints.server.tool_calls import ToolCall, ToolPlan, plan_tools
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.runtime import render_chat_template

# apply_chat_template's own arguments where the tokenizer does not say (transformers 4.5x-5.x)
_TEMPLATE_CALL_ARGS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def template_variables(tokenizer: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs -> the variables the template is rendered with. The tokenizer's own arguments
    (chat_template, tokenize, padding, max_length, return_tensors, ...) are refused: they would swap the template or
    change what rendering returns, and add_generation_prompt / continue_final_message / tools have request fields."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise APIError.bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    try:
        call_args = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    except (AttributeError, TypeError, ValueError):
        call_args = _TEMPLATE_CALL_ARGS
    refused = sorted(set(kwargs) & (call_args | _TEMPLATE_CALL_ARGS))
    if refused:
        raise APIError.bad_request(f"chat_template_kwargs may only set template variables; {', '.join(refused)} "
                                   "are arguments of the tokenizer's apply_chat_template", "chat_template_kwargs")
    return dict(kwargs)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Wire messages -> the plain dicts chat templates expect (text parts joined like vLLM does)."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise APIError.bad_request(f"only text content parts are supported, got {bad[0]!r}",
                                           f"messages.{i}.content")
            if any(p.text is None for p in content):
                raise APIError.bad_request("a text content part needs its text", f"messages.{i}.content")
            content = "\n".join(p.text or "" for p in content)
        entry: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
        if msg.name is not None:
            entry["name"] = msg.name
        for extra in ("tool_calls", "tool_call_id"):  # a tool-calling conversation sent back
            if (msg.model_extra or {}).get(extra) is not None:
                entry[extra] = msg.model_extra[extra]
        out.append(entry)
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **template_kwargs: Any) -> list[int]:
    """Runtime.apply_chat_template's rendering with the request's template options; engine thread only."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    return render_chat_template(tokenizer, messages, add_generation_prompt, **template_kwargs)


def _check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError.bad_request("prompt_logprobs is not supported with stream in chat completions "
                                   "(/v1/completions streams them)", "prompt_logprobs")
    if req.chat_template is not None:
        raise APIError.bad_request("chat_template in a request is not supported: the model's own template renders "
                                   "the messages", "chat_template")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError.bad_request("continue_final_message and add_generation_prompt cannot both be true "
                                   "(set add_generation_prompt to false)", "continue_final_message")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError.bad_request(f"top_logprobs must be an integer in [0, 20], got {req.top_logprobs}",
                                   "top_logprobs")


def _usage(final: RequestOutput) -> UsageInfo:
    return UsageInfo.of(final.num_prompt_tokens, final.num_completion_tokens)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Any) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse

    model = ctx.resolve_model(req.model)
    _check_chat(req)
    messages = message_dicts(req.messages)
    template_kwargs = template_variables(ctx.tokenizer, req.chat_template_kwargs)
    if req.continue_final_message:
        template_kwargs["continue_final_message"] = True
    # echo: the reply continues the last message's role, so it is shown from that message's start (vLLM's rule)
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == "assistant" else ""
    tokenizer = ctx.tokenizer
    fields = sampling_fields(req)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if plan is not None:
        messages, tool_kwargs = plan.render(messages, getattr(tokenizer, "chat_template", None))
        template_kwargs.update(tool_kwargs)
        tool_constraint = plan.structured()
        if tool_constraint is not None:
            if "structured_outputs" in fields:
                raise APIError.bad_request("tool_choice required or a named function constrains the output "
                                           "already; drop response_format / structured_outputs", "tool_choice")
            fields["structured_outputs"] = tool_constraint
    prompt = lambda: render_chat(tokenizer, messages, req.add_generation_prompt, **template_kwargs)
    if req.logprobs:
        fields["logprobs"] = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        params: Any = make_params({**fields, "max_tokens": max_tokens})
    else:  # the rest of the context, as OpenAI and vLLM do; validated now so errors come back early
        make_params({**fields, "max_tokens": 1})
        params = lambda ids: make_params({**fields, "max_tokens": max(1, ctx.max_model_len - len(ids))})
    request_id = new_id("chatcmpl")
    created = int(time.time())
    check_fits_queue(ctx, 1, req.n)
    streams = await submit(ctx, request_id, [prompt], params)
    top_k = req.top_logprobs or 0
    if req.stream:
        body = _stream(ctx, streams[0], request_id, created, model, req, top_k, plan, echo)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        final = (await unless_disconnected(raw, collect(streams), lambda: abort_all(ctx, streams)))[0]
    except Exception as exc:
        abort_all(ctx, streams)
        raise to_api_error(exc) from exc
    choices = []
    for c in final.outputs:
        content, calls = plan.parse(c.text) if plan is not None else (echo + c.text, [])
        choices.append(ChatChoice(
            index=c.index, message=AssistantMessage(content=content, tool_calls=[
                ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls]
                or None),
            logprobs=chat_logprobs(c.logprobs or [], top_k) if req.logprobs else None,
            finish_reason=_finish_reason(c, calls), stop_reason=c.stop_reason))
    response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=_usage(final), prompt_logprobs=prompt_logprobs(final.prompt_logprobs)
                                      if final.prompt_logprobs is not None else None)
    return JSONResponse(response.model_dump())


def _finish_reason(comp: CompletionOutput, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and comp.finish_reason == "stop" else comp.finish_reason


def _tool_deltas(content: str | None, calls: list[ToolCall]) -> list[DeltaMessage]:
    """A tool-calling choice's text, parsed once it is complete, as OpenAI streams it: any content, then per
    call a delta with its id and name and one with its arguments."""
    deltas = [DeltaMessage(content=content)] if content else []
    for i, call in enumerate(calls):
        deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=call.id, type="function",
                                                             function=DeltaFunctionCall(name=call.name,
                                                                                        arguments=""))]))
        deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(
            arguments=call.arguments))]))
    return deltas


async def _stream(ctx: ServerContext, stream: RequestStream, request_id: str, created: int, model: str,
                  req: ChatCompletionRequest, top_k: int, plan: ToolPlan | None = None,
                  echo: str = "") -> AsyncIterator[str]:
    report = StreamUsage.of(req.stream_options)
    latest: RequestOutput | None = None

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        if usage is None and report.continuous and latest is not None:
            usage = _usage(latest)
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage))

    done: set[int] = set()
    try:
        for i in range(req.n):  # the role first, as OpenAI does, before any content
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            if echo and plan is None:
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echo))])
        final: RequestOutput | None = None
        async for out in stream:
            latest = out
            for comp in out.outputs:
                finish = comp.finish_reason if comp.finished and comp.index not in done else None
                if plan is not None:  # a tool call is known only once its text is complete
                    if finish:
                        done.add(comp.index)
                        content, calls = plan.parse(comp.text)
                        for delta in _tool_deltas(content, calls):
                            yield chunk([ChatStreamChoice(index=comp.index, delta=delta)])
                        yield chunk([ChatStreamChoice(index=comp.index, delta=DeltaMessage(),
                                                      finish_reason=_finish_reason(comp, calls),
                                                      stop_reason=comp.stop_reason)])
                    continue
                new_logprobs = req.logprobs and bool(comp.delta_logprobs)
                if not (comp.delta_text or finish or new_logprobs):
                    continue
                if finish:
                    done.add(comp.index)
                logprobs = chat_logprobs(comp.delta_logprobs or [], top_k) if req.logprobs else None
                delta = DeltaMessage(content=comp.delta_text) if comp.delta_text or not finish else DeltaMessage()
                yield chunk([ChatStreamChoice(index=comp.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                              stop_reason=comp.stop_reason if finish else None)])
            if out.finished:
                final = out
        if report.final and final is not None:
            yield chunk([], _usage(final))
        yield SSE_DONE
    except Exception as exc:  # engine failure mid-stream: the header is out, so report in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_all(ctx, [stream])
