"""Incremental detokenization of generated tokens, with stop strings and safe streaming deltas."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context in front of the first generated token, so that the decoder applies
# the same rules (sentencepiece leading-space stripping, byte-fallback runs) as it would to the whole
# sequence instead of treating the first output token as the start of a text.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a request's growing list of generated token ids into text, a few tokens at a time.

    Each update decodes only the window ``ids[prefix_offset:]`` and subtracts the text of
    ``ids[prefix_offset:read_offset]`` (already produced, kept as context). The decoded span stays a few
    tokens long whatever the output length, and tokens whose text depends on their neighbours (bytes of
    one character split over several byte-level tokens, a leading '▁' that decoders strip at the start
    of a text) produce the same text as decoding the whole sequence at once.

    A trailing '\\ufffd' in the window means a character is still incomplete: the text before it is
    committed, the rest waits (in ``output_text`` but not streamed) until later tokens complete it or
    the request finishes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output

        self._ids = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        context = self._decode(self._prefix_offset, self._read_offset)
        # A window that begins inside a character decodes to U+FFFD there, and a byte-fallback decoder
        # garbles the whole run of byte tokens it begins, including output bytes that join the run.
        while context.startswith(_REPLACEMENT):
            self._prefix_offset += 1
            context = self._decode(self._prefix_offset, self._read_offset)
        if context.endswith(_REPLACEMENT):
            # The prompt ends inside a character. Completing it from the output would rewrite prompt
            # text, so the output is decoded on its own, as tokenizer.decode(output_ids) would.
            self._prefix_offset = self._read_offset
        self._window_committed = 0  # chars of the current window's new text already in _text
        # Committed output text (complete characters, stop-truncated). A StringIO rather than a str, whose
        # += copies the whole output on every token; only its last few chars are ever read back mid-stream.
        self._text = io.StringIO()
        self._text_len = 0
        self._tail = ""  # an incomplete character at the end, waiting for more tokens
        self._emitted = 0  # length of the committed prefix already returned by take_delta
        self._stop_str: str | None = None
        self._finished = False
        # Without stop strings nothing needs the text until it is read, so tokens wait here and are decoded in
        # one window when it is (`output_text`, `take_delta`): a decode pair costs ~12 us of host time whatever
        # its length, once per read instead of once per token (a verify step emits several tokens at once, and
        # an offline request reads its text only when it finishes). Any chunking decodes to the same text.
        self._unread: list[int] = []

    @property
    def output_text(self) -> str:
        self._decode_unread()
        return self._text.getvalue() + self._tail

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_str

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append generated tokens; return the stop string if the output now contains one.

        Once a stop string has matched, the output is final and later tokens are ignored. With `check_stop` false
        (fewer outputs than min_tokens, as vLLM) the new text is not searched; a later search only finds a stop
        string that ends in text committed from then on.
        """
        if self._finished:
            raise RuntimeError("update() after take_delta(finished=True)")
        if self._stop_str is not None or not new_token_ids:
            return None
        if not self._stop:
            self._unread.extend(new_token_ids)
            return None
        return self._append(new_token_ids, check_stop)

    def _decode_unread(self) -> None:
        if self._unread:
            unread, self._unread = self._unread, []
            self._append(unread)

    def _append(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))[len(prefix_text) :]
        complete = new_text.rstrip(_REPLACEMENT)
        self._tail = new_text[len(complete) :]
        committed = self._window_committed
        if new_text and not self._tail:
            # The window ends on a character boundary: the tokens read so far become the next context.
            # Tokens that decoded to nothing (skipped special tokens) are not enough context: a decoder
            # that strips the first leading space of a text would strip the next token's space instead.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._window_committed = 0
        else:
            self._window_committed = len(complete)
        # Text before an incomplete character decodes the same whatever bytes follow, so it is final.
        return self._commit(complete[committed:], check_stop)

    def take_delta(self, finished: bool = False) -> str:
        """Return the text that is safe to stream since the last call.

        While not finished, a tail of the output that could still grow into a stop string is held back;
        with ``finished=True`` everything in ``output_text`` is returned, and the detokenizer is closed.
        """
        self._decode_unread()
        if finished and not self._finished:
            self._finished = True
            if self._tail and self._stop_str is None:
                tail, self._tail = self._tail, ""
                self._commit(tail)
        end = self._text_len
        if not finished and self._stop_str is None:
            end -= self._stop_prefix_len()
        if end <= self._emitted:
            return ""
        delta, self._emitted = self._read(self._emitted, end), end
        return delta

    def _decode(self, start: int, end: int) -> str:
        # clean_up_tokenization_spaces rewrites text depending on what follows (" ." -> "."), which would
        # break the prefix subtraction, so it is always off.
        return self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _read(self, start: int, end: int) -> str:
        self._text.seek(start)
        return self._text.read(end - start)

    def _commit(self, text: str, check_stop: bool = True) -> str | None:
        """Append final text to the output and truncate it at the first stop string, if one appears."""
        if not text:
            return None
        # A match not found before must end in the new text, so it starts at most max_len-1 chars earlier.
        start = max(self._text_len - self._max_stop_len + 1, 0)
        self._text.seek(self._text_len)
        self._text_len += self._text.write(text)
        if not self._stop or not check_stop:
            return None
        window = self._read(start, self._text_len)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = window.find(s)
            # Earliest match wins; on a tie the longer string, which only matters when it is kept.
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -len(best[1]))):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text_len = start + i + (len(s) if self._include_stop else 0)
        self._text.truncate(self._text_len)
        self._tail = ""
        self._stop_str = s
        return s

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent suffix of the output that is a proper prefix of a stop string."""
        if not self._stop:
            return 0
        # Text already sent was, when sent, not part of any stop prefix, so no longer suffix can be one now.
        text = self._read(max(self._text_len - self._max_stop_len + 1, self._emitted), self._text_len)
        for k in range(len(text), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self._stop):
                return k
        return 0
