"""Cross-origin requests (CORS), so a browser UI on another origin can call the API: vLLM's options and defaults
(every origin, method and header; no credentials). Starlette's middleware answers the preflight OPTIONS request
before the API-key check, which lets OPTIONS through for the same reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def install(self, app: Any) -> None:
        """Added last, so it is the outermost middleware (Starlette runs the last added first)."""
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)
