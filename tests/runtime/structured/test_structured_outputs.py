"""Structured outputs on the embedded SmolLM2-135M (eager, fp32, CPU): every constrained output obeys its
constraint, checked by an independent validator (pydantic for the schema, `re` for regex and grammar)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from kiln import Runtime, SamplingParams, StructuredOutputsParams
from kiln.runtime.structured.compiler import GrammarCompiler

pytestmark = pytest.mark.slow

# an enum, bounded integers, maxLength strings and a nested array of objects
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 12},
        "name": {"type": "string", "maxLength": 8},
        "parts": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"label": {"type": "string", "maxLength": 6},
                           "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["label", "qty"]}},
    },
    "required": ["color", "count", "name", "parts"],
}


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    label: Annotated[str, Field(max_length=6)]
    qty: Annotated[int, Field(ge=0, le=99)]


class Thing(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    color: Literal["red", "green", "blue"]
    count: Annotated[int, Field(ge=1, le=12)]
    name: Annotated[str, Field(max_length=8)]
    parts: Annotated[list[Part], Field(max_length=2)]


ASK = [{"role": "user", "content": "Describe a toy as JSON: color, count, name and its parts."}]


@pytest.fixture(scope="module")
def runtime(embedded_dir) -> Runtime:
    rt = Runtime(str(embedded_dir), level=0, device="cpu", kv_cache_bytes=256 << 20, max_num_batched_tokens=1024)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def prompt(runtime) -> list[int]:
    return runtime.apply_chat_template(ASK)


def schema_params(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=96, temperature=0.8, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs)


SEEDS = range(20)
FREE = SamplingParams(max_tokens=16, temperature=0.8, seed=100)
PREEMPT_SEED = 42


def mixed_constrained() -> SamplingParams:
    return schema_params(200, n=2, logprobs=2)  # two rows, each with its own matcher


@pytest.fixture(scope="module")
def sync_batch(runtime, prompt) -> dict:
    """One synchronous generate over every independent request the tests compare against (the requests are
    seeded, so each samples what it samples alone): the 20 sampled schema requests, the mixed test's free and
    constrained requests, and the preemption test's request unpreempted. The cost is the longest output's steps."""
    params = [schema_params(seed) for seed in SEEDS] + [FREE, mixed_constrained(), schema_params(PREEMPT_SEED)]
    runtime.engine.async_scheduling = False
    outs = runtime.generate([prompt] * len(params), params)
    n = len(SEEDS)
    return {"sampled": outs[:n], "free": outs[n], "constrained": outs[n + 1], "preempt": outs[n + 2]}


def test_twenty_sampled_schema_outputs_are_all_valid(sync_batch) -> None:
    outs = sync_batch["sampled"]
    assert len(outs) == 20
    texts = [o.outputs[0].text for o in outs]
    for out, text in zip(outs, texts):
        assert out.outputs[0].finish_reason == "stop", text
        Thing.model_validate_json(text)  # raises on any violation
    assert len(set(texts)) > 5  # sampled, not one forced string


def test_choice_regex_and_grammar_outputs_match(runtime, prompt) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    regex = StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6}-\d{2,3}")
    grammar = StructuredOutputsParams(grammar='root ::= item (", " item)*\nitem ::= "cat" | "dog" | [0-9]+')
    specs = [choice] * 2 + [regex] * 2 + [grammar] * 2
    outs = runtime.generate([prompt] * len(specs), [
        SamplingParams(max_tokens=20, temperature=0.8, seed=i, structured_outputs=s) for i, s in enumerate(specs)])
    texts = [o.outputs[0].text for o in outs]
    assert all(t in ("yes", "no", "maybe so") for t in texts[:2]), texts
    assert all(re.fullmatch(r"[A-Z][a-z]{2,6}-\d{2,3}", t) for t in texts[2:4]), texts
    # a grammar may run to max_tokens (its list is unbounded); every prefix of it is still well formed
    assert all(re.fullmatch(r"(cat|dog|\d+)(, (cat|dog|\d+))*(, ?)?", t) for t in texts[4:]), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:4])


def test_a_grammar_that_ends_keeps_its_last_tokens_text(runtime, prompt) -> None:
    """With ignore_eos a constrained request ends on the grammar's last token, which is output (its text stays),
    unlike an EOS or stop token id whose text is left out."""
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    outs = runtime.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True,
                                                          structured_outputs=choice) for i in range(3)])
    for out in outs:
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        assert text in ("yes", "no", "maybe so") and text == runtime.tokenizer.decode(ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "stop"


def test_mixed_batch_async_and_n2_with_logprobs(runtime, prompt, sync_batch) -> None:
    """Half the batch constrained: the free half samples exactly what it samples alone, the constrained half
    is valid, and async scheduling (the mask filled after the previous step's tokens land) changes nothing.
    The synchronous run of the same two requests is the module's shared batch (sync_batch), checked here too."""
    alone = runtime.generate([prompt], FREE)[0].outputs[0].token_ids
    assert sync_batch["free"].outputs[0].token_ids == alone
    engine = runtime.engine
    engine.async_scheduling = True
    try:
        outs = runtime.generate([prompt] * 2, [FREE, mixed_constrained()])
    finally:
        engine.async_scheduling = False
    assert outs[0].outputs[0].token_ids == alone
    for constrained in (outs[1], sync_batch["constrained"]):
        assert len(constrained.outputs) == 2
        for comp in constrained.outputs:
            Thing.model_validate_json(comp.text)
            assert len(comp.logprobs) == len(comp.token_ids)
            assert all(lp.sampled.logprob > float("-inf") for lp in comp.logprobs)
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in sync_batch["constrained"].outputs]


def test_preempted_constrained_request_stays_valid(runtime, prompt, sync_batch) -> None:
    """Preemption (recompute) keeps the output tokens, so the matcher continues where it was: the output is
    the one the same seed gives without preemption (in the module's shared batch)."""
    expected = sync_batch["preempt"].outputs[0]
    engine = runtime.engine
    request_id = engine.add_request(prompt, schema_params(PREEMPT_SEED))
    final = None
    preempted = False
    while final is None:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        req = engine.scheduler.requests.get(request_id)
        if not preempted and req is not None and len(req.output_token_ids) >= 8:
            before = engine.scheduler.num_preemptions
            engine.scheduler.running.remove(req)
            engine.scheduler._preempt(req)  # what schedule() does when the KV pool runs out
            assert engine.scheduler.num_preemptions == before + 1
            preempted = True
    assert preempted
    assert final.outputs[0].token_ids == expected.token_ids
    Thing.model_validate_json(final.outputs[0].text)


@pytest.mark.parametrize("kwargs, words", [
    ({"json": "{not json"}, ["structured_outputs.json", "invalid"]),
    ({"json": {"type": "strin"}}, ["structured_outputs.json", "strin"]),
    ({"regex": "(ab"}, ["structured_outputs.regex", "parenthesis"]),
    ({"grammar": "root ::= missing"}, ["structured_outputs.grammar", "missing"]),
    ({"choice": []}, ["choice"]),
    ({"json": {"type": "object"}, "regex": "a+"}, ["exactly one", "json, regex"]),
    ({}, ["exactly one", "none"]),
    ({"json": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}, ["structured_outputs.json", "allOf"]),
    ({"json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}},
     ["structured_outputs.json", "properties.a.uniqueItems", "not supported"]),
    ({"json": {"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}}, ["anyOf[1].not"]),
])
def test_invalid_specs_are_value_errors_naming_the_field(kwargs, words) -> None:
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_vllm_options_kiln_holds_one_way_are_taken_and_others_refused() -> None:
    """vLLM's disable_any_whitespace / disable_additional_properties / disable_fallback are taken at any value
    (kiln's outputs obey the constraint either way); an option kiln does not have is refused by name."""
    params = StructuredOutputsParams.from_dict({"json": {"type": "object"}, "disable_any_whitespace": False,
                                                "disable_additional_properties": True, "disable_fallback": True})
    assert params == StructuredOutputsParams(json={"type": "object"})
    with pytest.raises(ValueError, match="unknown structured_outputs field.*whitespace_pattern"):
        StructuredOutputsParams.from_dict({"regex": "a+", "whitespace_pattern": " "})


# each keyword refused, with a schema using it and a text that breaks it
UNENFORCED = {
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
}


@pytest.mark.parametrize("keyword", UNENFORCED)
def test_refused_schema_keywords_are_ones_the_grammar_would_not_enforce(keyword: str) -> None:
    """A refused keyword is one xgrammar compiles and ignores: its grammar accepts a text that breaks it. (Once an
    xgrammar enforces one, this fails and the keyword can be let through.)"""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema, breaking = UNENFORCED[keyword]
    with pytest.raises(ValueError, match=keyword):
        StructuredOutputsParams(json=schema)
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True), breaking)


def test_keywords_as_property_names_and_a_described_ref_are_taken() -> None:
    """Only schema keywords count (not a property named "not"), and an allOf of one schema beside annotations (a
    field's description beside its type's $ref, as generators write it) is enforced, so it is taken."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"$defs": {"N": {"type": "integer"}}, "type": "object", "required": ["not", "a"],
              "properties": {"not": {"type": "string"}, "a": {"description": "d", "allOf": [{"$ref": "#/$defs/N"}]}}}
    grammar = StructuredOutputsParams(json=schema).parsed
    assert accepts(grammar, '{"not": "x", "a": 1}') and not accepts(grammar, '{"not": "x", "a": "s"}')


def test_a_repeated_schema_is_a_cache_hit(runtime) -> None:
    engine = runtime.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.spec.vocab_size, engine.eos_token_ids)
    try:
        first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
        assert compiler.compile(StructuredOutputsParams(json=dict(SCHEMA))) is first  # even while compiling
        first.result(timeout=60)
        assert compiler.compile(StructuredOutputsParams(json=SCHEMA)) is first
        other = compiler.compile(StructuredOutputsParams(regex="a+"))
        assert other is not first and (compiler.hits, compiler.misses) == (2, 2)
        other.result(timeout=60)
    finally:
        compiler.shutdown()
