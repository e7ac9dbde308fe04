"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.structured.params import StructuredOutputsParams

_REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("max_tokens", "top_k", "n", "min_tokens", "logprobs", "prompt_logprobs", "seed",
               "truncate_prompt_tokens")
_GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: the rest of the context (max_model_len - prompt tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    # added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans, +100 forces); given
    # as {token_id: bias}, kept as sorted (token_id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these ids (vLLM's), kept sorted
    bad_words: tuple[str, ...] = ()  # never completed in the output (vLLM's: a word's last token is banned where the
    # tokens before it were just generated; the word with and without a leading space)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (vLLM's; -1: max_model_len - 1)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                   f"must be a finite number, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(value is None or _is_integer(value), name, f"must be an integer, got {value!r}")
        if 0.0 < self.temperature < _GREEDY_BELOW:  # 1/T would overflow the logits: as greedy, as vLLM does
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "stop", _strings(self.stop, "stop"))
        ids = _sequence(self.stop_token_ids, "stop_token_ids")
        _check(all(_is_token_id(t) for t in ids), "stop_token_ids",
               f"must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        # the integer fields' types are checked above; what follows bounds their values
        _check(self.max_tokens is None or self.max_tokens >= 1,
               "max_tokens", f"must be None (the rest of the context) or an integer >= 1, got {self.max_tokens!r}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens), "min_tokens",
               f"must be in [0, max_tokens], got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= 20, name,
                   f"must be None or an integer in [0, 20], got {value!r}")
        _check(self.seed is None or -2**63 <= self.seed <= 2**64 - self.n, "seed",
               f"must be an integer in [-2**63, 2**64 - n] (choice i seeds with seed + i), got {self.seed!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = list(self.allowed_token_ids)
            _check(bool(allowed) and all(_is_token_id(t) for t in allowed),
                   "allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        object.__setattr__(self, "bad_words", _strings(self.bad_words, "bad_words"))
        _check(all(isinstance(w, str) and w.strip() and _encodable(w) for w in self.bad_words), "bad_words",
               f"must be non-blank strings of characters (no lone surrogates), got {self.bad_words!r}")
        k = self.truncate_prompt_tokens
        _check(k is None or k >= 1 or k == -1,
               "truncate_prompt_tokens", f"must be None, -1 (max_model_len) or an integer >= 1, got {k!r}")
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from user input, rejecting unknown fields by name."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)


def _sequence(value: Any, name: str) -> tuple[Any, ...]:
    """None or a list / tuple -> a tuple."""
    _check(value is None or isinstance(value, (list, tuple)), name, f"must be a list, got {value!r}")
    return tuple(value or ())


def _encodable(text: str) -> bool:
    """False for text holding a lone UTF-16 surrogate, which is no character: the tokenizer cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _strings(value: Any, name: str) -> tuple[str, ...]:
    """A string or a list of them (stop, bad_words) -> a tuple."""
    return (value,) if isinstance(value, str) else _sequence(value, name)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """{token_id: bias} (or pairs) -> sorted (int, float) pairs; ids >= 0, biases finite and in [-100, 100]."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias or ())
    out = {}
    for pair in pairs:
        _check(isinstance(pair, (tuple, list)) and len(pair) == 2, "logit_bias",
               f"must map token ids to biases, got {pair!r}")
        token, value = pair
        _check(_is_token_id(token), "logit_bias",
               f"keys must be token ids (integers >= 0), got {token!r}")
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
               "logit_bias", f"values must be numbers in [-100, 100], got {value!r} for token {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_integer(value) and value >= 0


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
