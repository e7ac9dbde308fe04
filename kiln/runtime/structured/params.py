"""`StructuredOutputsParams`: which constraint a request's output obeys (vLLM's names), checked and parsed.

Exactly one kind per request. The spec is parsed into an xgrammar `Grammar` at construction (a millisecond
for a schema): an invalid schema, regex or grammar is a ValueError here, naming the field, before anything is
queued. Compiling the grammar against the vocabulary (the expensive part) happens later, off the step path.
"""

from __future__ import annotations

import json as jsonlib
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_XGR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # xgrammar EBNF (GBNF-style: `root ::= ...`)
    # the parsed xgrammar Grammar; not compared: two params with the same spec are equal
    parsed: Any = field(default=None, init=False, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, dict):
                object.__setattr__(self, "json", jsonlib.dumps(self.json))  # key order kept: it orders properties
            elif not isinstance(self.json, str):
                raise ValueError(f"structured_outputs.json must be a schema dict or JSON text, "
                                 f"got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be a boolean")
        object.__setattr__(self, "parsed", _parse(self.kind, self.spec))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def spec(self) -> str:
        """The constraint as text: with `kind`, the grammar cache's key."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return jsonlib.dumps(list(self.choice))  # type: ignore[arg-type]
        return getattr(self, kind)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From user input (the server's `structured_outputs`), rejecting unknown fields by name."""
        if not isinstance(values, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(values) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in values.items() if v is not None})


def _parse(kind: str, spec: str) -> Any:
    import xgrammar as xgr

    try:
        if kind == "json":
            schema = jsonlib.loads(spec)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            # an object, not any JSON value (OpenAI's json_object mode)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # JSON string literals are valid EBNF literals: quotes and backslashes arrive escaped
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(jsonlib.dumps(c) for c in jsonlib.loads(spec)))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as exc:
        message = _XGR_LOCATION.sub("", str(exc)).strip().splitlines()[0]
        raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None
