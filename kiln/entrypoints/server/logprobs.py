"""Engine logprobs -> the two OpenAI shapes (completions: parallel lists; chat: one object per token)."""

from __future__ import annotations

from typing import Any

from kiln.entrypoints.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from kiln.runtime.outputs import Logprob, RequestOutput, TokenLogprobs

# JSON has no -inf; vLLM clamps to the same floor, so clients see identical numbers.
_FLOOR = -9999.0


def _text(lp: Logprob) -> str:
    return lp.decoded if lp.decoded is not None else f"token_id:{lp.token_id}"


def _value(lp: Logprob) -> float:
    return max(float(lp.logprob), _FLOOR)


def completion_logprobs(positions: list[TokenLogprobs], text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where this slice starts in the choice's text (streams continue from the last chunk)."""
    out = CompletionLogprobs()
    for pos in positions:
        token = _text(pos.sampled)
        out.tokens.append(token)
        out.token_logprobs.append(_value(pos.sampled))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        # the sampled token is always listed too (as vLLM does), so logprobs=0 still yields a dict per token
        out.top_logprobs.append({token: _value(pos.sampled), **{_text(lp): _value(lp) for lp in pos.top}})
    return out


def echo_logprobs(first_token: str, prompt: list[TokenLogprobs | None], positions: list[TokenLogprobs],
                  text_offset: int = 0) -> CompletionLogprobs:
    """`echo`: the prompt's tokens, the first without a logprob (none exists; vLLM reports it so), then the
    completion's `positions`. `prompt` is RequestOutput.prompt_logprobs (its first entry None)."""
    rest = completion_logprobs([*prompt[1:], *positions], text_offset + len(first_token))  # type: ignore[list-item]
    return CompletionLogprobs(text_offset=[text_offset, *rest.text_offset], token_logprobs=[None, *rest.token_logprobs],
                              tokens=[first_token, *rest.tokens], top_logprobs=[None, *rest.top_logprobs])


def prompt_logprobs(prompt: list[TokenLogprobs | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: {token id: logprob, rank, text}, the prompt's token then the top k."""
    return [None if pos is None else {lp.token_id: PromptLogprob(logprob=_value(lp), rank=lp.rank,
                                                                 decoded_token=lp.decoded)
                                      for lp in (pos.sampled, *pos.top)} for pos in prompt]


def next_offset(logprobs: CompletionLogprobs) -> int:
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def chat_logprobs(positions: list[TokenLogprobs], top_k: int) -> ChatLogprobs:
    content = []
    for pos in positions:
        token = _text(pos.sampled)
        top = [TopLogprob(token=_text(lp), logprob=_value(lp), bytes=list(_text(lp).encode()))
               for lp in pos.top[:top_k]]
        content.append(ChatTokenLogprob(token=token, logprob=_value(pos.sampled), bytes=list(token.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


class TokenTexts:
    """Fills Logprob.decoded for new logprobs; must run on the thread that owns the tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}  # bounded by the vocabulary

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else str(self.tokenizer.decode([token_id]))
            self._cache[token_id] = text
        return text

    def fill(self, out: RequestOutput) -> None:
        positions = [p for comp in out.outputs for p in comp.delta_logprobs or []]
        prompt = out.prompt_logprobs
        if prompt and prompt[-1] is not None and prompt[-1].sampled.decoded is None:  # complete, not yet filled
            positions += prompt[1:]
        for position in positions:
            for lp in (position.sampled, *position.top):
                if lp.decoded is None:
                    lp.decoded = self.text(lp.token_id)
