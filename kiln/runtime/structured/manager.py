"""What the engine sees of structured outputs: a grammar state per request, requests held until their grammar
is compiled, the step's mask, and each accepted token.

Built on the first constrained request (xgrammar's vocabulary tables cost ~0.3 s for a 49k vocabulary, a
model that never sees one does not pay). Rank 0 owns all of it under tensor parallelism: the mask applies to
the gathered logits that rank 0 samples from.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kiln.runtime.request import Request
from kiln.runtime.structured.bitmask import TokenBitmask
from kiln.runtime.structured.compiler import GrammarCompiler
from kiln.runtime.structured.matcher import GrammarState, GrammarStatus
from kiln.runtime.structured.params import StructuredOutputsParams

logger = logging.getLogger("kiln")


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], max_rows: int,
                 device: torch.device) -> None:
        if tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.bitmask = TokenBitmask(max_rows, self.compiler.vocab_size, device)
        self.stop_token_ids = stop_token_ids
        self.held: list[Request] = []  # added, waiting for their grammar before the scheduler sees them

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compiler.compile(params), self.stop_token_ids)

    def take_compiled(self) -> tuple[list[Request], list[Request]]:
        """(held requests whose grammar is ready, those whose grammar failed); both leave the hold.
        Requests ended meanwhile (aborted) are dropped."""
        ready, failed, still = [], [], []
        for req in self.held:
            if req.finished:
                continue
            status = req.grammar.status
            if status is GrammarStatus.COMPILING:
                still.append(req)
            else:
                (ready if status is GrammarStatus.READY else failed).append(req)
        self.held = still
        return ready, failed

    def wait_for_any(self, timeout: float) -> None:
        if self.held:
            self.held[0].grammar.wait(timeout)

    def mask(self, requests: list[Request]) -> torch.Tensor | None:
        """The sampling rows' mask, or None where no row is constrained. Called once the previous step's tokens
        are accepted, so its upload also never races the previous one's (the host buffer is reused)."""
        states = [r.grammar for r in requests]
        if all(s is None for s in states):
            return None
        return self.bitmask.fill(states)

    @staticmethod
    def accept(req: Request, token_id: int) -> bool:
        """Advance the request's matcher; True when its output is complete (stop token accepted) or the token
        broke the grammar (only possible where the mask was overridden, e.g. min_tokens forcing past EOS)."""
        state = req.grammar
        if state.terminated:
            return True
        if not state.accept(token_id):
            logger.warning("request %s: token %d is not allowed by its grammar; ending it", req.request_id, token_id)
            return True
        return state.terminated

    def shutdown(self) -> None:
        self.compiler.shutdown()
