"""Engine logprobs -> the two OpenAI shapes (completions: parallel lists; chat: one object per token)."""

from __future__ import annotations

from typing import Any

from kiln.entrypoints.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
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
        for comp in out.outputs:
            for position in comp.delta_logprobs or []:
                for lp in (position.sampled, *position.top):
                    if lp.decoded is None:
                        lp.decoded = self.text(lp.token_id)
