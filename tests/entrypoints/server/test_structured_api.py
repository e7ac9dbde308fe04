"""Structured outputs and tool calls through the official openai client against a kiln server (embedded
SmolLM2-135M, -O0, CPU): the answers parse and obey their constraint; invalid specs are 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.entrypoints.server.conftest import MODEL, Served

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "country": {"enum": ["France", "Spain", "Italy"]},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["city", "country", "population_millions"],
}


class City(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: Annotated[str, Field(max_length=16)]
    country: Literal["France", "Spain", "Italy"]
    population_millions: Annotated[int, Field(ge=0, le=40)]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: Annotated[str, Field(max_length=20)]
    unit: Literal["celsius", "fahrenheit"]


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: Annotated[str, Field(max_length=20)]


ASK_CITY = [{"role": "user", "content": "Tell me about the capital of France as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema_and_json_object(served: Served) -> None:
    client = served.openai()
    out = client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0.8, seed=1,
                                         n=2, response_format=JSON_SCHEMA_FORMAT)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        City.model_validate_json(choice.message.content)
    out = client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=120, temperature=0.8, seed=2,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


def test_streamed_schema_output_parses_while_a_bad_request_is_refused(served: Served) -> None:
    client = served.openai()
    stream = iter(client.chat.completions.create(
        model=MODEL, messages=ASK_CITY, max_tokens=80, temperature=0.8, seed=3, stream=True,
        response_format=JSON_SCHEMA_FORMAT))
    chunks = [next(stream), next(stream)]
    with pytest.raises(openai.BadRequestError):  # refused beside it: the stream goes on untouched
        client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "(ab"}})
    chunks += list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    City.model_validate_json(text)


def test_completions_structured_outputs_choice_regex_grammar(served: Served) -> None:
    client = served.openai()
    kinds = [({"choice": ["Paris", "Lyon", "Nice"]}, r"Paris|Lyon|Nice"),
             ({"regex": r"\d{4}-\d{2}-\d{2}"}, r"\d{4}-\d{2}-\d{2}"),
             ({"grammar": 'root ::= "(" [a-z]+ ")"'}, r"\([a-z]+\)")]
    for extra, pattern in kinds:
        out = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=24, temperature=0.8,
                                        seed=4, extra_body={"structured_outputs": extra})
        assert out.choices[0].finish_reason == "stop" and re.fullmatch(pattern, out.choices[0].text), out
    out = client.completions.create(model=MODEL, prompt="A city as JSON:", max_tokens=80, temperature=0.8, seed=5,
                                    extra_body={"response_format": JSON_SCHEMA_FORMAT})
    City.model_validate_json(out.choices[0].text)


def test_vllm_legacy_guided_fields_constrain_as_structured_outputs(served: Served) -> None:
    """guided_choice / guided_regex / guided_json (vLLM before 0.12) constrain like the structured_outputs key of
    the same kind: the same seeded text; guided_decoding_backend is accepted and ignored."""
    client = served.openai()
    cases = [("guided_choice", ["Paris", "Lyon", "Nice"], "choice"), ("guided_regex", r"\d{4}-\d{2}", "regex"),
             ("guided_json", SCHEMA, "json")]
    for legacy, spec, key in cases:
        bodies = ({legacy: spec, "guided_decoding_backend": "xgrammar"}, {"structured_outputs": {key: spec}})
        texts = [client.completions.create(model=MODEL, prompt="The answer is", max_tokens=60, temperature=0.8,
                                           seed=6, extra_body=body).choices[0].text for body in bodies]
        assert texts[0] == texts[1], (legacy, texts)
    City.model_validate_json(texts[0])


def test_tool_choice_required_and_named(served: Served) -> None:
    client = served.openai()
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=120, temperature=0.8, seed=6)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        model = {"get_weather": WeatherArgs, "get_time": TimeArgs}[call.function.name]
        model.model_validate_json(call.function.arguments)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)

    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                         tool_choice=named, max_tokens=60, temperature=0.8, seed=7)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    TimeArgs.model_validate_json(call.function.arguments)

    # streamed: OpenAI's tool-call deltas, accumulated as a client does
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                                tool_choice="required", max_tokens=120, temperature=0.8, seed=8,
                                                stream=True):
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["name"] == "get_weather" and entry["id"].startswith("call_")
        WeatherArgs.model_validate_json(entry["arguments"])


def test_parallel_tool_calls_false_gives_one_call_that_ends_the_answer(served: Served) -> None:
    """With parallel_tool_calls false, "required" allows one call: the array closes after it and the answer ends
    there (with several allowed, this sampled model went on adding calls until max_tokens)."""
    out = served.openai().chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                                  temperature=0.8, seed=6)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    {"get_weather": WeatherArgs, "get_time": TimeArgs}[call.function.name].model_validate_json(call.function.arguments)


def test_tool_choice_auto_renders_tools_and_answers(served: Served) -> None:
    """auto: the tools reach the prompt (SmolLM2's template has no `tools`, so a system message carries them)
    and the answer is either text or well-formed tool calls."""
    client = served.openai()
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=1)
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="auto",
                                         max_tokens=60, temperature=0)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool's schema is in the prompt
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        WeatherArgs.model_validate_json(message.tool_calls[0].function.arguments)
    else:
        assert message.content and out.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nope"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"extra_body": {"chat_template_kwargs": {"return_tensors": "np"}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}}, "chat_template_kwargs"),
    ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}}, "guided_choice"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
    ({"extra_body": {"guided_json": SCHEMA, "guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),
])
def test_invalid_specs_are_400s_naming_the_field(served: Served, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        served.openai().chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert served.health()["running"] == 0
