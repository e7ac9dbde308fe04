"""`kiln serve | generate | chat | warmup | bench | cache` — one entry point, subcommands loaded lazily."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

from kiln.config import KV_CACHE_DTYPES, CUDAGraphMode
from kiln.passes.config import ALL_PASSES

# subcommand -> module with `add_parser(subparsers)`; each sets `func` on its parser
SUBCOMMANDS = {
    "generate": "kiln.entrypoints.cli.generate",
    "serve": "kiln.entrypoints.cli.serve",
    "chat": "kiln.entrypoints.cli.chat",
    "bench": "kiln.entrypoints.cli.bench",
    "warmup": "kiln.entrypoints.cli.cache",
    "cache": "kiln.entrypoints.cli.cache",
}


def add_runtime_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """The options every model-running command shares (model, level, device, dtype, limits)."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="HF model directory or preset name (default: embedded SmolLM2-135M-Instruct)")
    for level in range(4):
        parser.add_argument(f"-O{level}", dest="level", action="store_const", const=level,
                            help=f"optimisation level {level}" + (" (default)" if level == 2 else ""))
    parser.set_defaults(level=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="HF tokenizer directory (default: the model's own; a dummy preset has none)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 on GPU, 64 on CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of a step (default: 8192 on GPU, 2048 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-n", type=int, default=None, help="the most sequences (n) one request may ask for "
                        "(default 128)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache size in bytes (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                        help="KV cache element type: auto (the model dtype, default) or fp8 (e4m3, per-layer "
                             "scale 1.0: about twice the tokens in the same memory)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap each step's scheduling and token processing with the previous forward "
                             "(default: on with one GPU, off on the CPU and under tensor parallelism)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                        help="shard the model over N GPUs (or N CPU processes) of this host")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="mixture-of-experts models: place whole experts on the ranks instead of splitting each")
    parser.add_argument("--cudagraph-mode", default=None, choices=CUDAGraphMode.ALL,
                        help="override the level's CUDA graph mode")
    parser.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None, metavar="N",
                        help="token counts to capture graphs for (default: 1, 2, 4, 8, 16, ... up to 512)")
    parser.add_argument("--compile-sizes", type=int, nargs="*", default=None, metavar="N",
                        help="exact token counts compiled with static shapes (none: the ranges serve all)")
    parser.add_argument("--background-compile-sizes", type=int, nargs="*", default=None, metavar="N",
                        help="exact token counts compiled after start-up and swapped in (default on a GPU: -O2's "
                             "1 2 4 8, -O3's extras)")
    parser.add_argument("--inductor-option", action="append", default=None, metavar="NAME=VALUE",
                        type=parse_inductor_option,
                        help="an Inductor config entry for every compile, VALUE as JSON (e.g. combo_kernels=false); "
                             "repeatable")
    parser.add_argument("--compile-workers", type=int, default=None, metavar="N",
                        help="processes for Inductor compiles (default: half the cores, at most 16; 1: serial)")
    parser.add_argument("--passes", nargs="*", default=None, metavar="PASS",
                        help=f"kiln fusion passes to enable ({', '.join(ALL_PASSES)}; NAME<=N: up to N tokens); "
                             "omitted: the level's defaults; given with no name: none")
    parser.add_argument("--compile-dump", default=None, metavar="DIR",
                        help="write Dynamo/depyf, split-graph and Inductor output code here")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="FP8 linear weights, quantized at load (FP8 checkpoints are detected on their own)")
    parser.add_argument("--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": '
                             '4} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}')
    parser.add_argument("--seed", type=int, default=0)


def parse_speculative_config(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    return value


def parse_inductor_option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` (VALUE as JSON) -> (name, value): `--inductor-option` here and in the benchmarks."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a JSON value (true, 3, \"max-autotune\")") from None


def runtime_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the user set: explicit flags override the level's defaults, unset ones don't."""
    kwargs: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "load_format": args.load_format,
                              "attention_backend": args.attention_backend, "seed": args.seed}
    if getattr(args, "tokenizer", None):
        kwargs["tokenizer"] = args.tokenizer
    for name in ("level", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_n", "kv_cache_bytes",
                 "gpu_memory_utilization", "tensor_parallel_size", "cudagraph_mode", "compile_workers",
                 "quantization", "kv_cache_dtype", "enable_expert_parallel", "speculative_config"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    for name in ("cudagraph_capture_sizes", "compile_sizes", "background_compile_sizes"):
        if getattr(args, name, None) is not None:
            kwargs[name] = tuple(getattr(args, name))
    if getattr(args, "passes", None) is not None:
        kwargs.update(passes=tuple(args.passes), enable_passes=bool(args.passes))
    if getattr(args, "no_prefix_caching", False):
        kwargs["enable_prefix_caching"] = False
    if getattr(args, "async_scheduling", None) is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if getattr(args, "compile_dump", None):
        kwargs["debug_dump_path"] = args.compile_dump
    if getattr(args, "inductor_option", None):
        kwargs["inductor_options"] = dict(args.inductor_option)
    return kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(SUBCOMMANDS.values()):  # unique, in order
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as exc:  # a subsystem that is not installed must not break the others
            if f"'{module}'" not in str(exc):
                raise
            continue
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, or a path that is not what it should be
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
