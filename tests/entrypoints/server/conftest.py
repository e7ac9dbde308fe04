"""A kiln server on 127.0.0.1 (uvicorn on a thread, the embedded SmolLM2 at -O0), started once per module.

A module tunes its server with a module-level SERVER_OPTIONS dict (api_key, max_model_len, ...).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.entrypoints.server.app import build_app, create_context
from kiln.entrypoints.server.context import ServerContext
from kiln.entrypoints.server.launcher import ServerThread
from kiln.runtime.engine import Engine
from kiln.runtime.runtime import build_config

MODEL = "smol"
# small enough to keep two engines (server + reference Runtime) cheap, big enough for 100 short requests
KV_BYTES = 256 << 20


@dataclass
class Served:
    url: str
    ctx: ServerContext
    thread: ServerThread
    api_key: str | None

    @property
    def engine(self) -> Engine:
        return self.ctx.engine.engine

    def openai(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Until nothing runs, waits or is in flight; returns the last /health body."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.health()
            if body["running"] == 0 and body["waiting"] == 0 and body["active_requests"] == 0:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {body}")
            time.sleep(0.05)


def start_server(model_dir: Path, *, api_key: str | None = None, max_queue: int | None = None,
                 **engine_kwargs: Any) -> Served:
    kwargs = {"level": 0, "device": "cpu", "kv_cache_bytes": KV_BYTES, **engine_kwargs}
    engine = Engine(build_config(str(model_dir), **kwargs))
    ctx = create_context(engine, [MODEL], api_key=api_key, max_queue=max_queue, drain_timeout=5)
    thread = ServerThread(build_app(ctx), ctx).start()
    return Served(thread.url, ctx, thread, api_key)


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, embedded_dir: Path) -> Iterator[Served]:
    server = start_server(embedded_dir, **getattr(request.module, "SERVER_OPTIONS", {}))
    yield server
    server.thread.stop()
