"""Which compile is in progress: the piece and the token-count range or size Inductor is compiling for.

Inductor calls the post-grad hook with nothing but the graph, while a pass may only suit some token
counts (e.g. small decode batches). The compiler wraps each Inductor compile in `compiling(...)`; the pass
manager reads it to gate passes, name dumps and attribute match counts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CompileScope:
    name: str  # file-name safe: "<piece hash>_<key>"
    lo: int  # token counts this compile serves, inclusive
    hi: int
    exact: bool  # an exact size (static shapes)


_scope: contextvars.ContextVar[CompileScope | None] = contextvars.ContextVar("kiln_compile_scope", default=None)


def current_scope() -> CompileScope | None:
    return _scope.get()


@contextlib.contextmanager
def compiling(name: str, key: object) -> Iterator[CompileScope]:
    """Mark an Inductor compile of piece `name` for `key` (anything with lo, hi and exact: a CompileKey)."""
    scope = CompileScope(name, int(key.lo), int(key.hi), bool(key.exact))  # type: ignore[attr-defined]
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)
