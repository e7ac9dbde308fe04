"""API-key check as a plain ASGI middleware (BaseHTTPMiddleware would sit between streaming responses and
the disconnect signal the handlers rely on to abort requests)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

from kiln.entrypoints.server.errors import APIError

# /health and /metrics stay open, as in vLLM: probes and Prometheus scrapers carry no key.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str, on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_error = on_error

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope.get("path", "").startswith(PROTECTED_PREFIXES)):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
        if self.on_error is not None:
            self.on_error(401)
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
