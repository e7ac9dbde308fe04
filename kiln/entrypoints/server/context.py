"""What every handler needs: the async engine, the served model names, limits and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kiln.entrypoints.server.async_engine import AsyncEngine
from kiln.entrypoints.server.cors import CorsPolicy
from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: AsyncEngine
    served_model_names: list[str]
    metrics: ServerMetrics
    api_key: str | None = None
    drain_timeout: float = 30.0
    cors: CorsPolicy = CorsPolicy()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        """Only for reading attributes (chat_template); calls into it belong on the engine thread."""
        return self.engine.engine.tokenizer

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; a missing name means the default model (as vLLM does)."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist. Available: "
                           f"{', '.join(self.served_model_names)}", type_="not_found_error",
                           param="model", code="model_not_found")
        return requested
