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
        # read for every decoding request every step (the engine's host time is per-request Python at batch 64)
        children = self.children
        if len(children) == 1:
            return children[0].status.finished
        return all(c.status.finished for c in children)

    def make_output(self) -> RequestOutput:
        """Everything so far, plus the deltas since the last output."""
        completions = []
        all_done = True
        for i, (req, detok) in enumerate(zip(self.children, self.detokenizers)):
            done = req.status.finished
            all_done = all_done and done
            tokens = req.output_token_ids
            new_tokens = tokens[self.reported_tokens[i]:]
            self.reported_tokens[i] = len(tokens)
            delta_logprobs = None
            if req.logprobs is not None:
                delta_logprobs = req.logprobs[self.reported_logprobs[i]:]
                self.reported_logprobs[i] = len(req.logprobs)
            delta_text = detok.take_delta(finished=done) if detok is not None else ""  # before output_text: it flushes
            completions.append(CompletionOutput(
                index=i,
                text=detok.output_text if detok is not None else "",
                # a live list while running (copying every step would be quadratic), a copy once finished
                token_ids=list(tokens) if done else tokens,
                finish_reason=req.status.value if done else None,
                stop_reason=req.stop_reason,
                logprobs=req.logprobs,
                delta_text=delta_text,
                delta_token_ids=new_tokens,
                delta_logprobs=delta_logprobs,
            ))
        first = self.children[0]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             all_done, first.metrics, first.num_cached_tokens, first.prompt_logprobs)
