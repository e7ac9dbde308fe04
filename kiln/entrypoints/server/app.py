"""The FastAPI application: routes, error handlers, API key, and the engine thread's lifetime (lifespan)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

# At module level (not inside build_app) because FastAPI resolves the handlers' string annotations
# against this module's globals; this module is only imported by the server, so `import kiln` stays cheap.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kiln.entrypoints.server.async_engine import AsyncEngine
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.cors import CorsPolicy
from kiln.entrypoints.server.errors import APIError, install_error_handlers
from kiln.entrypoints.server.metrics import ServerMetrics
from kiln.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine


def default_model_name(model: str | None) -> str:
    if model is None:
        from kiln.models.loader.gguf_import import EMBEDDED_MODEL_NAME

        return EMBEDDED_MODEL_NAME
    return model


def create_context(engine: Engine, served_model_names: list[str] | None = None, *, api_key: str | None = None,
                   max_queue: int | None = None, drain_timeout: float = 30.0,
                   cors: CorsPolicy | None = None) -> ServerContext:
    names = served_model_names or [default_model_name(engine.config.model)]
    metrics = ServerMetrics(engine, names[0])
    async_engine = AsyncEngine(engine, max_queue=max_queue, metrics=metrics)
    return ServerContext(async_engine, names, metrics, api_key=api_key, drain_timeout=drain_timeout,
                         cors=cors or CorsPolicy())


def health_body(ctx: ServerContext) -> dict[str, Any]:
    engine = ctx.engine.engine
    return {
        "status": "ok" if ctx.engine.is_healthy and ctx.engine.accepting else "unavailable",
        "running": ctx.engine.num_running,
        "waiting": ctx.engine.num_waiting,
        "active_requests": ctx.engine.num_active,
        "kv_free_blocks": engine.pool.num_free,
        "kv_usable_blocks": engine.pool.num_usable,
        "kv_allocated_requests": engine.kv.num_allocated_requests,
        "step_failures": ctx.engine.num_step_failures,
    }


def build_app(ctx: ServerContext) -> FastAPI:
    from kiln.entrypoints.server.serving_chat import create_chat_completion, message_dicts, render_chat
    from kiln.entrypoints.server.serving_completion import create_completion

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            # uvicorn has already waited for (or cancelled) in-flight requests; stop the loop thread
            await ctx.engine.drain(0.0)
            await ctx.engine.shutdown()

    app = FastAPI(title="kiln", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app, ctx.metrics.observe_error)
    if ctx.api_key:
        from kiln.entrypoints.server.auth import ApiKeyMiddleware

        app.add_middleware(ApiKeyMiddleware, api_key=ctx.api_key, on_error=ctx.metrics.observe_error)
    ctx.cors.install(app)

    @app.get("/health")
    async def health() -> Any:
        body = health_body(ctx)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        payload, content_type = ctx.metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/version")
    async def version() -> Any:
        from kiln import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> Any:
        cards = [ModelCard(id=name, created=ctx.created, root=str(ctx.engine.engine.config.model or name),
                           max_model_len=ctx.max_model_len) for name in ctx.served_model_names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(ctx, body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        ctx.resolve_model(body.model)
        engine = ctx.engine.engine
        if (body.prompt is None) == (body.messages is None):
            raise APIError.bad_request("give exactly one of prompt and messages")
        if body.messages is not None:
            messages = message_dicts(body.messages)
            fn = lambda: render_chat(engine.tokenizer, messages, body.add_generation_prompt)
        else:
            text = body.prompt or ""
            fn = lambda: _encode(engine.tokenizer, text, body.add_special_tokens)
        tokens = await _on_engine_thread(ctx, fn)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len).model_dump()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        ctx.resolve_model(body.model)
        engine = ctx.engine.engine
        fn = lambda: _decode(engine.tokenizer, body.tokens)
        return DetokenizeResponse(prompt=await _on_engine_thread(ctx, fn)).model_dump()

    return app


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    bad = [t for t in tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise ValueError(f"tokens must be in [0, {len(tokenizer)}); got {bad[:5]}")
    return str(tokenizer.decode(tokens))


async def _on_engine_thread(ctx: ServerContext, fn: Any) -> Any:
    from kiln.entrypoints.server.serving_common import to_api_error

    try:
        return await ctx.engine.call(fn)
    except Exception as exc:
        raise to_api_error(exc) from exc
