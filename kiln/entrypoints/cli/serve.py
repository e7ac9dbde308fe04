"""`kiln serve [MODEL] [-O0..-O3] [--host] [--port] [--api-key] ...`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.entrypoints.cli.main import add_runtime_args, runtime_kwargs

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_runtime_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=8000,
                   help="port (0: any free port; the URL is printed)")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $KILN_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported in responses")
    p.add_argument("--max-queue", type=_max_queue, default=1024,
                   help="requests allowed to wait for a batch slot before new ones get 503 (-1: no limit)")
    p.add_argument("--drain-timeout", type=_bounded(float, 0.0, 86400.0), default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS: a JSON list of origins")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: a JSON list of HTTP methods")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: a JSON list of request headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while loading")
    p.set_defaults(func=run)


def _bounded(kind: type, low: float, high: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value
    return parse


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers take them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {text}")
    return value


def _max_queue(text: str) -> int:
    value = int(text)
    if value < 1 and value != -1:  # 0 would refuse every request
        raise argparse.ArgumentTypeError(f"must be -1 (no limit) or >= 1, got {text}")
    return value


def build_engine(model: str | None, kwargs: dict[str, Any], progress: bool = True) -> Engine:
    """Load weights, then build the engine (KV cache, compile and warm-up), each a stage of a progress bar."""
    from tqdm import tqdm

    from kiln.config import resolve_device
    from kiln.models.loader.load import load_model
    from kiln.runtime.engine import Engine
    from kiln.runtime.runtime import build_config
    from kiln.runtime.startup import StartupClock
    from kiln.runtime.worker import BACKGROUND_WEIGHT_DEVICES

    config = build_config(model, **kwargs)
    device = resolve_device(config.device)
    # the load runs here, outside the engine, to be its own progress stage: time it on the engine's start-up
    # clock so the summary's `load` and `total` include it
    clock = StartupClock(device)
    with tqdm(total=2, unit="stage", disable=not progress, file=sys.stderr,
              bar_format="{desc:<44}{bar:20}| {n_fmt}/{total_fmt} [{elapsed}]") as bar:
        bar.set_description("loading weights")
        with clock.phase("load"):  # on a GPU the weights go on streaming in while the engine compiles
            loaded = load_model(config.model, device=device, dtype=config.dtype, load_format=config.load_format,
                                seed=config.seed, quantization=config.quantization,
                                expert_parallel=config.enable_expert_parallel,
                                background=device.type in BACKGROUND_WEIGHT_DEVICES)
        bar.update(1)
        bar.set_description("building engine (KV cache, compile, warm-up)")
        engine = Engine(config, loaded, clock=clock)
        bar.update(1)
        bar.set_description("ready")
    return engine


def summary(engine: Engine, names: list[str], startup_seconds: float) -> str:
    from kiln.entrypoints.server.metrics import compile_stat

    compile_s = compile_stat(engine, "warmup_seconds") or (compile_stat(engine, "trace_seconds")
                                                          + compile_stat(engine, "compile_seconds"))
    loaded = engine.loaded
    rows = [
        ("model", f"{names[0]}" + (f" ({loaded.model_dir})" if loaded.model_dir else " (dummy weights)")),
        ("architecture", loaded.spec.architecture),
        ("dtype / device", f"{str(loaded.dtype).removeprefix('torch.')} / {engine.device}"),
        ("optimisation level", f"-O{engine.config.compilation.level}"),
        ("max model len", str(engine.max_model_len)),
        ("scheduling", f"{engine.config.scheduler.max_num_seqs} seqs, "
                       f"{engine.config.scheduler.max_num_batched_tokens} tokens a step, "
                       f"async {'on' if engine.async_scheduling else 'off'}"),
        ("KV cache", f"{engine.pool.num_usable} blocks x {engine.config.cache.block_size} tokens "
                     f"= {engine.kv_capacity_tokens} tokens of {str(engine.kv_cache.dtype).removeprefix('torch.')}"),
        ("load / compile seconds", f"{loaded.load_seconds:.1f} / {compile_s:.1f}"),
        ("compiled", f"{compile_stat(engine, 'dynamo_traces'):.0f} trace(s), "
                     f"{compile_stat(engine, 'inductor_compiles'):.0f} Inductor compile(s)"),
        ("start-up seconds", f"{startup_seconds:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    from kiln.entrypoints.server.app import build_app, create_context, default_model_name
    from kiln.entrypoints.server.cors import CorsPolicy
    from kiln.entrypoints.server.launcher import make_server

    start = time.perf_counter()
    engine = build_engine(args.model, runtime_kwargs(args), progress=not args.no_progress)
    names = args.served_model_name or [default_model_name(args.model)]
    cors = CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                      args.allow_credentials)
    ctx = create_context(engine, names, api_key=args.api_key,
                         max_queue=None if args.max_queue == -1 else args.max_queue, drain_timeout=args.drain_timeout,
                         cors=cors)
    print(f"kiln serve\n{summary(engine, names, time.perf_counter() - start)}", flush=True)
    # Everything alive at ready lives as long as the server: out of the collector's sight. A full collection
    # otherwise walks every module, tensor and compiled artifact, and serving triggers them (96 requests at -O0
    # on the CPU met two, of 132 and 195 ms: a stall of every stream); with the start-up heap frozen one took
    # 0.0 ms against 0.26-0.31 s (the embedded model's -O2 CPU engine, 444k objects, alternated in one process).
    # No collection first: it would add as much to the start, and the start-up's own garbage (55k objects after
    # a cold -O2 start there) is a fixed cost of the process.
    gc.freeze()

    def started(url: str) -> None:
        print(f"kiln: serving {names[0]!r} at {url}/v1 (API key {'required' if args.api_key else 'off'})",
              flush=True)

    server = make_server(build_app(ctx), ctx, args.host, args.port, log_level=args.log_level,
                         access_log=not args.no_access_log, on_started=started)
    server.run()
    print("kiln: server stopped", flush=True)
    return 0
