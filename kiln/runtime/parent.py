"""A user request as the engine tracks it: its n child requests, their detokenizers, and what was reported."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.request import Request


@dataclass
class ParentRequest:
    """A user request: its n children and what was last reported for each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    reported_tokens: list[int] = field(default_factory=list)
    reported_logprobs: list[int] = field(default_factory=list)
    final_only: bool = False  # reported once, when finished (Engine.add_request)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def make_output(self) -> RequestOutput:
        """Everything so far, plus the deltas since the last output."""
        completions = []
        for i, (req, detok) in enumerate(zip(self.children, self.detokenizers)):
            new_tokens = req.output_token_ids[self.reported_tokens[i]:]
            self.reported_tokens[i] = len(req.output_token_ids)
            delta_logprobs = None
            if req.logprobs is not None:
                delta_logprobs = req.logprobs[self.reported_logprobs[i]:]
                self.reported_logprobs[i] = len(req.logprobs)
            delta_text = detok.take_delta(finished=req.finished) if detok is not None else ""
            completions.append(CompletionOutput(
                index=i,
                text=detok.output_text if detok is not None else "",
                # a live list while running (copying every step would be quadratic), a copy once finished
                token_ids=list(req.output_token_ids) if req.finished else req.output_token_ids,
                finish_reason=req.status.value if req.finished else None,
                stop_reason=req.stop_reason,
                logprobs=req.logprobs,
                delta_text=delta_text,
                delta_token_ids=new_tokens,
                delta_logprobs=delta_logprobs,
            ))
        first = self.children[0]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             self.finished, first.metrics, first.num_cached_tokens, first.prompt_logprobs)
