"""`kiln bench serve` (load-test an OpenAI-compatible endpoint) and `kiln bench throughput` (offline)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: serve (against an HTTP endpoint), throughput (offline)")
    bench = p.add_subparsers(dest="bench_command", required=True)

    s = bench.add_parser("serve", help="load-test an OpenAI-compatible server and print latency percentiles")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    s.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    s.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir: exact random prompt lengths, token-accurate ShareGPT output lengths")
    s.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    s.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (kiln/vLLM extension)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--disable-tqdm", action="store_true")
    s.add_argument("--save-result", default=None, metavar="FILE", help="also write the summary as JSON")
    _dataset_args(s, num_prompts=100)
    s.set_defaults(func=run_serve)

    t = bench.add_parser("throughput", help="offline throughput through Runtime.generate")
    add_runtime_args(t)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--output-json", default=None, metavar="FILE")
    _dataset_args(t, num_prompts=64, seed=False)  # add_runtime_args already has --seed
    t.set_defaults(func=run_throughput)


def _dataset_args(p: argparse.ArgumentParser, num_prompts: int, seed: bool = True) -> None:
    p.add_argument("--dataset", choices=["random", "sharegpt"], default=None,
                   help="default: sharegpt when --dataset-path is given, else random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=128)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=64)
    p.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for ShareGPT")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def _requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int | None = None) -> list[Any]:
    from kiln.entrypoints.bench.datasets import random_requests, sharegpt_requests

    kind = args.dataset or ("sharegpt" if args.dataset_path else "random")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if kind == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, tokenizer, args.sharegpt_output_len)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                           tokenizer, vocab_size)


def _save(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def run_serve(args: argparse.Namespace) -> int:
    from kiln.entrypoints.bench.serve import format_table, run_benchmark, summarize

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress bar
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    requests = _requests(args, tokenizer)
    results, duration, model = asyncio.run(run_benchmark(
        args.base_url, args.endpoint, args.model, requests, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, api_key=args.api_key, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, progress=not args.disable_tqdm))
    summary = summarize(results, duration)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"model: {model}  endpoint: {args.base_url}{args.endpoint}  request rate: {rate}  "
          f"max concurrency: {args.max_concurrency or 'none'}")
    print(format_table(summary), flush=True)
    _save(args.save_result, {"model": model, "request_rate": rate, "max_concurrency": args.max_concurrency,
                             **summary})
    return 0 if summary["completed"] else 1


def run_throughput(args: argparse.Namespace) -> int:
    from kiln import Runtime
    from kiln.entrypoints.bench.throughput import format_result
    from kiln.entrypoints.bench.throughput import run_throughput as run

    runtime = Runtime(args.model, **runtime_kwargs(args))
    # random prompts as token ids: exact lengths, and dummy-weight presets (no tokenizer) work too
    requests = _requests(args, runtime.tokenizer if args.dataset_path else None,
                         runtime.engine.loaded.spec.vocab_size)
    result = run(runtime, requests, temperature=args.temperature, seed=args.seed)
    print(format_result(result), flush=True)
    _save(args.output_json, result)
    return 0
