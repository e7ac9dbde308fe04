"""Running the app under uvicorn: in the foreground with a SIGTERM drain (`kiln serve`), or in a background
thread (tests, notebooks)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from kiln.entrypoints.server.context import ServerContext


def _server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's graceful shutdown (stop listening, wait for in-flight responses, then cancel them after
        timeout_graceful_shutdown), plus: refuse new requests on kept-alive connections at once, and exit 0
        instead of re-raising the signal, because a completed drain is a clean exit."""

        def __init__(self, config: Any, ctx: ServerContext, on_started: Callable[[str], None] | None) -> None:
            super().__init__(config)
            self.ctx = ctx
            self.on_started = on_started
            self.url: str | None = None

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers and self.servers[0].sockets:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
                if self.on_started is not None:
                    self.on_started(self.url)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.ctx.engine.stop_accepting()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for in-flight requests
            else:
                self.should_exit = True

    return DrainingServer


def make_server(app: Any, ctx: ServerContext, host: str = "127.0.0.1", port: int = 8000, *,
                log_level: str = "info", access_log: bool = True,
                on_started: Callable[[str], None] | None = None) -> Any:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=max(1, int(ctx.drain_timeout)),
                            timeout_keep_alive=5)
    return _server_class()(config, ctx, on_started)


class ServerThread:
    """uvicorn on a background thread with its own event loop; `url` is set once it listens."""

    def __init__(self, app: Any, ctx: ServerContext, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.server = make_server(app, ctx, host, port, log_level=log_level, access_log=False)
        self.thread = threading.Thread(target=self.server.run, name="kiln-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        assert self.server.url is not None, "server not started"
        return self.server.url

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while self.server.url is None:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
