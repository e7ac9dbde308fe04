"""`response_format` (OpenAI) and `structured_outputs` (vLLM's extra body) -> StructuredOutputsParams.

Either names one constraint; both at once is ambiguous and refused. Every problem is a 400 naming the field,
including an invalid schema, regex or grammar (StructuredOutputsParams parses the spec at construction).

vLLM's older top-level fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; removed in vLLM
0.12, whose server now ignores them and answers unconstrained) still arrive from clients written for them. Here
they stand for the `structured_outputs` key of the same kind, so such a client gets the constraint it asked for;
`guided_decoding_backend` names a backend and is ignored (kiln has one), and what has no kiln equivalent
(`guided_whitespace_pattern`) is refused rather than dropped.
"""

from __future__ import annotations

from typing import Any

from kiln.entrypoints.server.errors import APIError
from kiln.runtime.structured.params import StructuredOutputsParams

# vLLM's removed request fields -> the structured_outputs key each one stood for
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_params(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                      extra: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """`extra`: the request's fields outside the schema, where the legacy guided_* ones arrive."""
    from_format = _from_response_format(response_format)
    legacy = _legacy(extra or {})
    if legacy is not None:
        if structured_outputs is not None or from_format is not None:
            raise APIError.bad_request(f"set one of response_format, structured_outputs or {legacy[0]}, not several",
                                       legacy[0])
        structured_outputs = legacy[1]
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise APIError.bad_request("set either response_format or structured_outputs, not both",
                                   "structured_outputs")
    try:
        return StructuredOutputsParams.from_dict(structured_outputs)
    except (ValueError, TypeError) as exc:
        raise APIError.bad_request(str(exc), legacy[0] if legacy else "structured_outputs") from exc


def _legacy(extra: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(the guided_* field given, its structured_outputs equivalent), or None where none is given."""
    if extra.get("guided_whitespace_pattern") is not None:
        raise APIError.bad_request("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    given = [name for name in LEGACY_FIELDS if extra.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise APIError.bad_request(f"set one of {', '.join(given)}, not several", given[1])
    return given[0], {LEGACY_FIELDS[given[0]]: extra[given[0]]}


def _from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError.bad_request("response_format json_schema needs json_schema.schema, an object",
                                           "response_format.json_schema.schema")
            return StructuredOutputsParams(json=spec["schema"])
    except ValueError as exc:
        raise APIError.bad_request(str(exc).replace("structured_outputs.json", "response_format.json_schema"),
                                   "response_format") from exc
    raise APIError.bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                               "response_format")
