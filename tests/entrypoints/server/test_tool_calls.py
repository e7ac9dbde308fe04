"""Tool-call plans and parsers on the formats models emit (no model needed)."""

from __future__ import annotations

import json

import pytest

from kiln.entrypoints.server.errors import APIError
from kiln.entrypoints.server.tool_calls import plan_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def test_hermes_calls_with_leading_content() -> None:
    plan = plan_tools([ADD, NOW], "auto")
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    content, calls = plan.parse(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert calls[0].id != calls[1].id


def test_llama3_json_calls() -> None:
    plan = plan_tools([ADD, NOW], "auto")
    content, calls = plan.parse('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 3, "b": 4})]
    _, calls = plan.parse('{"name": "add", "parameters": {"a": 1, "b": 1}}; {"name": "now", "parameters": {}}')
    assert [c.name for c in calls] == ["add", "now"]


@pytest.mark.parametrize("text", ["Just text.", '{"name": "unknown", "parameters": {}}',
                                  "<tool_call>{broken</tool_call>", '{"a": 1}'])
def test_text_that_is_not_a_call_stays_content(text) -> None:
    content, calls = plan_tools([ADD], "auto").parse(text)
    assert content == text and calls == []


def test_required_and_named_plans_constrain_and_parse() -> None:
    required = plan_tools([ADD, NOW], "required")
    assert required.structured().kind == "json"
    _, calls = required.parse('[{"name": "now", "parameters": {}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]')
    assert [c.name for c in calls] == ["now", "add"]
    named = plan_tools([ADD, NOW], {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.structured().json) == ADD["function"]["parameters"]
    assert named.parse('{"a": 5, "b": 6}')[1][0].name == "add"
    assert plan_tools([ADD], "none") is None and plan_tools(None, None) is None


def test_parallel_tool_calls_false_allows_one_call() -> None:
    """parallel_tool_calls: false: "required"'s grammar takes one call, not two (so the output ends after it),
    and a parsed answer of several calls keeps the first (vLLM's rule)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    call = '{"name": "now", "parameters": {}}'
    one, two = f"[{call}]", f"[{call}, {call}]"
    for parallel, takes_two in ((True, True), (False, False)):
        grammar = plan_tools([ADD, NOW], "required", parallel).structured().parsed
        assert accepts(grammar, one) and accepts(grammar, two) == takes_two
    hermes = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
              '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert [c.name for c in plan_tools([ADD, NOW], "auto", False).parse(hermes)[1]] == ["add"]
    assert [c.name for c in plan_tools([ADD, NOW], "auto").parse(hermes)[1]] == ["add", "now"]
    assert [c.name for c in plan_tools([ADD, NOW], "required", False).parse(two)[1]] == ["now"]


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {}}], "auto", "tools"),
    ([ADD, {"type": "function", "function": {"name": "x", "parameters": []}}], "auto", "tools"),
    ([ADD], {"type": "function", "function": {"name": "sub"}}, "tool_choice"),
    ([ADD], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([ADD], {"type": "function", "function": "add"}, "tool_choice"),
    ([ADD], {"type": "function", "function": {"name": ["add"]}}, "tool_choice"),
    ([ADD], {"type": "retrieval", "function": {"name": "add"}}, "tool_choice"),
    (["add"], "auto", "tools"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice)
    assert info.value.status == 400 and info.value.param == param


BAD_SCHEMA = {"type": "function", "function": {"name": "bad", "parameters": {
    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_a_parameter_schema_the_grammar_cannot_take_is_a_400_naming_its_tool(choice) -> None:
    """required / a named tool constrain the output by the parameter schemas: one the grammar refuses is the
    request's fault (400 on tools, the tool's index in the message), not the server's."""
    plan = plan_tools([ADD, BAD_SCHEMA], choice)
    with pytest.raises(APIError) as info:
        plan.structured()
    assert info.value.status == 400 and info.value.param == "tools"
    assert "tools[1].function.parameters" in info.value.message and "nonsense" in info.value.message
    assert plan_tools([ADD, BAD_SCHEMA], {"type": "function", "function": {"name": "add"}}).structured() is not None
