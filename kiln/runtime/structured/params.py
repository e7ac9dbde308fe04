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
# JSON-schema keywords xgrammar (0.2.9) takes without enforcing them: an output could break them and still end with
# "stop", so a schema using one is refused by name (vLLM then falls back to another backend; kiln has only this one)
_UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "contains", "maxContains", "dependentRequired",
               "dependentSchemas", "dependencies")
# vLLM's options on how to hold a constraint that kiln holds one way (compact JSON, no property beyond the schema's,
# one backend): taken at any value, as every output kiln gives obeys the constraint either way
_FIXED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # items: a list in older drafts
_SUBSCHEMA_ONE = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
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
        values = {k: v for k, v in values.items() if k not in _FIXED_OPTIONS}
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
            where = _unenforced_keyword(schema)
            if where is not None:
                raise ValueError(f"{where} is not supported (the grammar backend would not enforce it)")
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


def _unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """Where the schema first uses a keyword xgrammar would not enforce (e.g. 'properties.a.not'), else None. An
    allOf of one schema beside nothing but annotations is enforced (a field's description beside its type's $ref,
    as schema generators write it); any other allOf is not."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema:
            return path + key
    all_of = schema.get("allOf")
    if all_of is not None and not (isinstance(all_of, list) and len(all_of) == 1 and
                                   set(schema) - _ANNOTATIONS == {"allOf"}):
        return path + "allOf"
    children: list[tuple[str, Any]] = []
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            children += [(f"{key}.{name}.", sub) for name, sub in value.items()]
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            children += [(f"{key}[{i}].", sub) for i, sub in enumerate(value)]
        elif key in _SUBSCHEMA_ONE:
            children.append((f"{key}.", value))
    return next((found for prefix, sub in children if (found := _unenforced_keyword(sub, path + prefix))), None)
