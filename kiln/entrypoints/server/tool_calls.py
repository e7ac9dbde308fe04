"""Function calling: `tools` + `tool_choice` -> how the request is rendered and constrained, and the model's
text -> OpenAI `tool_calls`.

- "none": tools are neither shown nor called.
- "required": the output is constrained to a JSON array of {"name": <a tool>, "parameters": <its schema>}.
- a named function: the output is constrained to that function's parameter schema (the arguments).
- "auto": the tools are rendered through the chat template (`tools=`), the model answers freely, and its
  tool-call format is parsed: Hermes/Qwen `<tool_call>{...}</tool_call>` or Llama-3's bare JSON
  `{"name": ..., "parameters": ...}` (after an optional `<|python_tag|>`). A template that does not read
  `tools` gets them in a system message, in the Hermes format, so the model still sees them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.entrypoints.server.errors import APIError
from kiln.runtime.structured.params import StructuredOutputsParams

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_SYSTEM = ("You may call one or more functions to assist with the user query. The functions are listed in "
           "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON object "
           "with the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    functions: tuple[dict[str, Any], ...]  # each {"name", "description"?, "parameters"?}
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: false allows one call ("required"'s grammar; auto keeps the first)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint for required / named; None for auto (free text, parsed afterwards). A parameter schema
        the grammar cannot take is a 400 naming its tool."""
        if self.mode == "named":
            i = next(i for i, f in enumerate(self.functions) if f["name"] == self.named)
            return _constraint(_parameters(self.functions[i]), i)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                        "parameters": _parameters(f)},
                      "required": ["name", "parameters"]} for f in self.functions]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if self.parallel else
                                                                                    {"maxItems": 1})}
            try:
                return StructuredOutputsParams(json=array)
            except ValueError as exc:  # each schema alone, to name the tool at fault (only on this error path)
                for i, f in enumerate(self.functions):
                    _constraint(_parameters(f), i)
                raise _bad_schema(exc, "the tools' parameter schemas") from None
        return None

    def render(self, messages: list[dict[str, Any]], chat_template: str | None) -> tuple[list, dict[str, Any]]:
        """(messages, template kwargs) that show the model its tools."""
        tools = [{"type": "function", "function": f} for f in self.functions]
        if chat_template and "tools" in chat_template:
            return messages, {"tools": tools}
        system = _SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{system}"}, *messages[1:]], {}
        return [{"role": "system", "content": system}, *messages], {}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of one choice's text; no calls where the text is not a call to a known tool."""
        content, calls = self._parse(text)
        return content, calls if self.parallel else calls[:1]

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return (None, [ToolCall(self.named, text)]) if _is_json_object(text) else (text, [])
        if self.mode == "required":
            items = _loads(text)
            calls = [ToolCall(c["name"], json.dumps(c["parameters"])) for c in items or []
                     if isinstance(c, dict) and c.get("name") in self.names]
            return (None, calls) if calls else (text, [])
        return self._parse_auto(text)

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" in text:
            bodies = [_loads(m) for m in _HERMES.findall(text)]
            calls = [self._call(b) for b in bodies]
            if calls and all(c is not None for c in calls):
                content = text[:text.index("<tool_call>")].strip()
                return content or None, calls  # type: ignore[return-value]
            return text, []
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            parsed = _loads(body)
            objects = parsed if isinstance(parsed, list) else [parsed] if parsed is not None else \
                [_loads(part) for part in body.split(";")]  # Llama-3.1 separates several calls with ';'
            calls = [self._call(o) for o in objects]
            if calls and all(c is not None for c in calls):
                return None, calls  # type: ignore[return-value]
        return text, []

    def _call(self, obj: Any) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments already as JSON text
            args = _loads(args)
        return ToolCall(obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool = True) -> ToolPlan | None:
    """The request's tool plan; None where no tool may be called. 400s name the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError.bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError.bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                       "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError.bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.append(fn)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(choice, tuple(functions), parallel=parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError.bad_request("a named tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                                       "tool_choice")
        if name not in {f["name"] for f in functions}:
            raise APIError.bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", tuple(functions), name, parallel)
    raise APIError.bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                               "tool_choice")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _constraint(schema: dict[str, Any], tool: int) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise _bad_schema(exc, f"tools[{tool}].function.parameters") from None


def _bad_schema(exc: ValueError, where: str) -> APIError:
    reason = str(exc).split(" is invalid: ", 1)[-1]
    return APIError.bad_request(f"{where} cannot constrain the output: {reason}", "tools")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def _is_json_object(text: str) -> bool:
    return isinstance(_loads(text), dict)
