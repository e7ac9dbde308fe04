"""Structured outputs: what a grammar costs to compile, to find again, and per decode step.

    python -m benchmarks.bench_structured                          # CPU, embedded SmolLM2-135M, batch 1 and 16
    python -m benchmarks.bench_structured --model llama3-8b --device cuda --level 2 --batches 1 16 64

1. Compile: a JSON schema compiled cold against the vocabulary (each one distinct, so none is a cache hit),
   then the same schema again (kiln's LRU: the finished Future). Timed through kiln's GrammarCompiler.
2. Decode: B requests decoding together, all constrained by a JSON schema vs all free, alternated twice in
   one process on one engine; mean step time over the steps where all B requests decode (a constrained one
   that completes its JSON early leaves, and those steps are not counted). tokens/s = B / step time.

A preset (random weights) has no tokenizer: `--tokenizer synthetic` writes a byte-level BPE of the model's
own vocabulary size (benchmarks/synthetic_tokenizer.py), so the mask spans the logits exactly, as with a real
checkpoint, and nothing needs downloading. Its tokens are random byte strings, not Llama-3's words: the mask's
cost per step depends on how many tokens each grammar state must check, which this keeps at the 128k scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import stamp
from kiln import Runtime, SamplingParams
from kiln.runtime.structured.compiler import GrammarCompiler
from kiln.runtime.structured.params import StructuredOutputsParams

# long-lived outputs (free strings and an array), an enum and a bounded integer: a typical extraction schema
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["person", "place", "thing"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "kind", "age", "summary", "tags"],
}
PROMPT = [{"role": "user", "content": "Write a long JSON profile (name, kind, age, summary, tags) of a famous "
                                      "scientist, with a detailed summary of their life."}]


def _schema_variant(i: int) -> dict[str, Any]:
    """SCHEMA with its first property renamed: the same compile work, a different cache key."""
    props = dict(SCHEMA["properties"])
    props[f"name{i}"] = props.pop("name")
    return {"type": "object", "properties": props, "required": [f"name{i}", *SCHEMA["required"][1:]]}


def bench_compile(engine: Any, repeats: int) -> dict[str, float]:
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.spec.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json_object=True)).result()  # includes the vocabulary tables
    first = time.perf_counter() - start
    cold = []
    for i in range(repeats):
        params = StructuredOutputsParams(json=_schema_variant(i))
        start = time.perf_counter()
        compiler.compile(params).result()
        cold.append(time.perf_counter() - start)
    hits = []
    for _ in range(repeats):
        params = StructuredOutputsParams(json=_schema_variant(0))  # built anew, as each request's would be
        start = time.perf_counter()
        compiler.compile(params).result()
        hits.append(time.perf_counter() - start)
    compiler.shutdown()
    return {"tokenizer_info_and_first_ms": first * 1e3, "compile_cold_ms": statistics.median(cold) * 1e3,
            "compile_cold_max_ms": max(cold) * 1e3, "cache_hit_ms": statistics.median(hits) * 1e3,
            "cache_hit_max_ms": max(hits) * 1e3}


def _sync(engine: Any) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_steps(engine: Any, prompt: list[int], batch: int, steps: int, constrained: bool) -> dict[str, float]:
    """Mean step time while all `batch` requests decode."""
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    for i in range(batch):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0.8, seed=i, ignore_eos=True,
                                                  structured_outputs=structured))
    def held() -> bool:
        return engine.structured is not None and bool(engine.structured.held)

    while held() or engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                                  for r in engine.scheduler.running):
        engine.step()  # grammar waits and prefill
    for _ in range(2):
        engine.step()
    _sync(engine)
    full, times = 0, []
    for _ in range(steps):
        if len(engine.scheduler.running) < batch:
            break
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        full += 1
    _sync(engine)
    while engine.has_unfinished():
        engine.step()
    # a steady state needs a few steps; with async scheduling one step's time is the device's, so the median
    # of back-to-back steps is the per-step cost
    return {"step_ms": statistics.median(times) * 1e3 if times else float("nan"), "full_steps": full}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", default=None, help="'synthetic': a BPE of the model's vocabulary size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--compile-repeats", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    kwargs: dict[str, Any] = {"device": args.device, "level": args.level}
    if args.model is not None and args.model in _presets():
        kwargs.update(load_format="dummy", dtype="bf16")
    if args.tokenizer == "synthetic":
        from benchmarks.synthetic_tokenizer import write_bpe_tokenizer
        from kiln.models.loader.presets import PRESETS

        preset = PRESETS[args.model]
        directory = tempfile.mkdtemp(prefix="kiln-bpe-")
        start = time.perf_counter()
        write_bpe_tokenizer(directory, preset["vocab_size"], bos_token_id=preset["bos_token_id"],
                            eos_token_id=preset["eos_token_id"])
        print(f"synthetic tokenizer written in {time.perf_counter() - start:.1f} s")
        kwargs["tokenizer"] = directory
    elif args.tokenizer is not None:
        kwargs["tokenizer"] = args.tokenizer
    rt = Runtime(args.model, **kwargs)
    engine = rt.engine
    result: dict[str, Any] = {"stamp": stamp(), "model": args.model or "embedded SmolLM2-135M-Instruct",
                              "level": args.level, "async_scheduling": engine.async_scheduling,
                              "vocab_size": engine.loaded.spec.vocab_size, "tokenizer_size": len(rt.tokenizer)}
    result["compile"] = bench_compile(engine, args.compile_repeats)
    prompt = rt.apply_chat_template(PROMPT) if getattr(rt.tokenizer, "chat_template", None) else \
        rt.tokenizer(PROMPT[0]["content"])["input_ids"]
    decode_steps(engine, prompt, 1, 4, True)  # warm-up: the kernels and the mask path, outside the timing
    rows = []
    for batch in args.batches:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(2):
            for constrained in (False, True):
                runs[constrained].append(decode_steps(engine, prompt, batch, args.steps, constrained))
        free = min(r["step_ms"] for r in runs[False])
        cons = min(r["step_ms"] for r in runs[True])
        rows.append({"batch": batch, "free_step_ms": free, "constrained_step_ms": cons, "ratio": cons / free,
                     "free_tok_s": batch / free * 1e3, "constrained_tok_s": batch / cons * 1e3,
                     "constrained_full_steps": min(r["full_steps"] for r in runs[True])})
    result["decode"] = rows
    rt.shutdown()

    print(stamp())
    print(f"model {result['model']} (vocab {result['vocab_size']}, tokenizer {result['tokenizer_size']}), "
          f"level {args.level}, async scheduling {engine.async_scheduling}")
    c = result["compile"]
    print(f"grammar compile (cold, median of {args.compile_repeats}): {c['compile_cold_ms']:.1f} ms "
          f"(max {c['compile_cold_max_ms']:.1f}); cache hit {c['cache_hit_ms'] * 1e3:.0f} us "
          f"(max {c['cache_hit_max_ms'] * 1e3:.0f}); vocabulary tables + first grammar "
          f"{c['tokenizer_info_and_first_ms']:.0f} ms")
    print(f"{'batch':>5} {'free ms':>9} {'json ms':>9} {'ratio':>6} {'free tok/s':>11} {'json tok/s':>11} {'steps':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free_step_ms']:>9.2f} {r['constrained_step_ms']:>9.2f} {r['ratio']:>6.3f} "
              f"{r['free_tok_s']:>11.1f} {r['constrained_tok_s']:>11.1f} {r['constrained_full_steps']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _presets() -> set[str]:
    from kiln.models.loader.presets import PRESETS

    return set(PRESETS)


if __name__ == "__main__":
    main()
