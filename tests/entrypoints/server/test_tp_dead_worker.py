"""A tensor-parallel worker that dies under a running server: requests get OpenAI-style errors (503 once the
engine is known dead), never a hang. CPU, 2 ranks over gloo."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server.conftest import MODEL, start_server

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def complete(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_dead_worker_turns_requests_into_503() -> None:
    served = start_server(Path("tiny-qwen3"), tensor_parallel_size=2)
    try:
        assert complete(served.url).status_code == 200
        worker = served.engine.tp.procs[0]
        worker.kill()
        worker.join(timeout=30)
        first = complete(served.url)  # the step that finds the worker dead fails this request, saying why
        assert first.status_code == 503 and "rank 1" in first.json()["error"]["message"], first.text
        later = complete(served.url)
        assert later.status_code == 503, later.text
        assert later.json()["error"]["message"]
    finally:
        served.thread.stop()
        served.engine.shutdown()
