"""OpenAI-style errors: one exception type for the handlers to raise, and the app-wide exception handlers.

Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}` with the status the
official client maps to its exception classes (400 BadRequest, 401 Authentication, 404 NotFound,
500 InternalServer, 503 ServiceUnavailable), so clients can tell a bad request from an overloaded server.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kiln.entrypoints.server.protocol import ErrorInfo, ErrorResponse
from kiln.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kiln.server")

# The first word of SamplingParams' / the engine's ValueError messages names the offending field.
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"prompt"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        if param is None:
            first = message.split(" ", 1)[0]
            param = first if first in _PARAM_NAMES else None
        return cls(400, message, param=param)

    @classmethod
    def unavailable(cls, message: str, code: str) -> APIError:
        return cls(503, message, type_="service_unavailable_error", code=code)

    @classmethod
    def internal(cls, message: str) -> APIError:
        return cls(500, message, type_="internal_server_error", code="engine_error")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def error_response(err: APIError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status)



def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    # a validator's own message (e.g. the union branch that matched the shape) says more than a branch's type error
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{first.get('msg', 'invalid value')}{where}{more}", param


def install_error_handlers(app: Any, on_error: Callable[[int], None] | None = None) -> None:
    """Map every exception to an OpenAI-style body; on_error(status) sees each one (for metrics)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def respond(err: APIError) -> Any:
        if on_error is not None:
            on_error(err.status)
        return error_response(err)

    async def on_api_error(request: Any, exc: APIError) -> Any:
        return respond(exc)

    async def on_validation(request: Any, exc: RequestValidationError) -> Any:
        message, param = _validation_message(list(exc.errors()))
        return respond(APIError(400, message, param=param))

    async def on_http(request: Any, exc: StarletteHTTPException) -> Any:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), type_=type_))

    async def on_unexpected(request: Any, exc: Exception) -> Any:
        # A bug in a handler: the request fails, the server stays up.
        logger.exception("unhandled error on %s", request.url.path)
        return respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                type_="internal_server_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
