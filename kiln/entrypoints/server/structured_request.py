"""`response_format` (OpenAI) and `structured_outputs` (vLLM's extra body) -> StructuredOutputsParams.

Either names one constraint; both at once is ambiguous and refused. Every problem is a 400 naming the field,
including an invalid schema, regex or grammar (StructuredOutputsParams parses the spec at construction).
"""

from __future__ import annotations

from typing import Any

from kiln.entrypoints.server.errors import APIError
from kiln.runtime.structured.params import StructuredOutputsParams


def structured_params(response_format: dict[str, Any] | None,
                      structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    from_format = _from_response_format(response_format)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise APIError.bad_request("set either response_format or structured_outputs, not both",
                                   "structured_outputs")
    try:
        return StructuredOutputsParams.from_dict(structured_outputs)
    except (ValueError, TypeError) as exc:
        raise APIError.bad_request(str(exc), "structured_outputs") from exc


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
