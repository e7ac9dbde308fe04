"""One request's place in its grammar: waits for the compiled grammar, then follows the accepted tokens.

The matcher holds exactly the request's known output tokens. Preemption in kiln recomputes the KV cache but
keeps the output tokens, so it leaves the matcher as is; `rollback` is for tokens taken back (speculation).
A void token (sampled for a request that ended meanwhile) is never accepted.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import Any


class GrammarStatus(enum.Enum):
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


class GrammarState:
    def __init__(self, compiled: Future, stop_token_ids: frozenset[int]) -> None:
        self._compiled = compiled
        self._stop_token_ids = sorted(stop_token_ids)
        self.matcher: Any = None
        self.error: str | None = None
        self.num_accepted = 0

    @property
    def status(self) -> GrammarStatus:
        if self.matcher is not None:
            return GrammarStatus.READY
        if self.error is not None:
            return GrammarStatus.FAILED
        if not self._compiled.done():
            return GrammarStatus.COMPILING
        try:
            import xgrammar as xgr

            # the stop tokens end an accepted output (the engine's EOS ids, not the tokenizer's guess)
            self.matcher = xgr.GrammarMatcher(self._compiled.result(),
                                              override_stop_tokens=self._stop_token_ids or None)
            return GrammarStatus.READY
        except Exception as exc:  # noqa: BLE001 - a grammar that does not compile fails its request only
            self.error = f"the grammar did not compile: {exc}"
            return GrammarStatus.FAILED

    def wait(self, timeout: float) -> None:
        """Block until the grammar is compiled (or failed), at most `timeout` seconds."""
        try:
            self._compiled.exception(timeout=timeout)
        except TimeoutError:
            pass

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the mask was not applied)."""
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """A stop token was accepted after a complete output: nothing more may follow."""
        return self.matcher.is_terminated()
