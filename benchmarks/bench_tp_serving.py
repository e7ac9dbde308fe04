"""Tensor parallelism at default settings (CUDA graphs on): decode step time sync and async, start-up, and
shutdown time, TP=1 against TP=N, each configuration in its own process under a wall-clock bound.

A configuration that fails or hangs (start-up, a step, or the shutdown) is recorded as such and the run goes
on; the parent kills a child that runs past --config-timeout. Every GPU number is printed next to the per-GPU
floor (weights of one shard + KV read at the copy bandwidth measured in the same child).

    # H200 x2 (about 12 min: two 8B builds and one 70B build, cold caches)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python -m benchmarks.bench_tp_serving --json tp_serving.json
    # CPU dry run (gloo)
    python -m benchmarks.bench_tp_serving --device cpu --configs tiny-llama:1 tiny-llama:2 --batches 1 4 \\
        --json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_CONFIGS = ["llama3-8b:1", "llama3-8b:2", "llama3-70b:2"]
PROMPT_LEN = 128


def run_one(args: argparse.Namespace) -> dict:
    """Child: build one runtime, measure each batch sync then async, then time its shutdown."""
    from benchmarks.common import decode_step_seconds
    from kiln import Runtime

    model, tp = args.one.split(":")
    out: dict = dict(model=model, tp=int(tp), rows=[], errors=[])
    kwargs = dict(device=args.device, load_format="dummy", level=args.level, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=int(tp))
    if args.device == "cuda":
        kwargs.update(dtype="bf16", gpu_memory_utilization=0.85, attention_backend="triton",
                      cudagraph_capture_sizes=tuple(args.capture_sizes))
    ceil = None
    if args.device == "cuda":
        from benchmarks.bench_gpu import measure_ceilings

        ceil = measure_ceilings()
    start = time.perf_counter()
    rt = Runtime(model, **kwargs)
    out["build_s"] = time.perf_counter() - start
    engine = rt.engine
    out["cudagraph_mode"] = str(engine.worker.compilation.cudagraph_mode)
    try:
        for batch in args.batches:
            for mode in ("sync", "async"):
                engine.async_scheduling = mode == "async"
                try:
                    step = decode_step_seconds(engine, batch, PROMPT_LEN, args.steps)
                except Exception as exc:  # recorded, the other measurements still run
                    out["errors"].append(f"batch {batch} {mode}: {exc!r}")
                    continue
                row = dict(batch=batch, mode=mode, step_ms=step * 1e3, tokens_per_s=batch / step)
                if ceil is not None:
                    from benchmarks.bench_gpu import decode_floor_seconds

                    floor = max(decode_floor_seconds(rt, batch, ceil))
                    row.update(floor_ms=floor * 1e3, x_floor=step / floor)
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
        out["graph_replays"] = engine.graph_replays
    finally:
        procs = list(engine._tp_procs)
        start = time.perf_counter()
        engine.shutdown()
        out["shutdown_s"] = time.perf_counter() - start
        out["worker_exit_codes"] = [p.exitcode for p in procs]
    return out


def run_all(args: argparse.Namespace) -> list[dict]:
    """Parent: one child process per configuration, each bounded by --config-timeout."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **MULTICAST_OFF, "PYTHONPATH": str(root)}
    results = []
    for config in args.configs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            part = f.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config, "--json", part, "--device",
               args.device, "--level", str(args.level), "--steps", str(args.steps),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--batches", *map(str, args.batches), "--capture-sizes", *map(str, args.capture_sizes)]
        print(f"== {config}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.config_timeout, capture_output=True, text=True)
            result = json.loads(Path(part).read_text()) if proc.returncode == 0 else dict(
                model=config, error=f"exit {proc.returncode}: {proc.stderr[-3000:]}")
            print(proc.stdout[-4000:], flush=True)
        except subprocess.TimeoutExpired as exc:
            result = dict(model=config, error=f"timed out after {args.config_timeout} s (a hang?)",
                          stderr=(exc.stderr or b"")[-3000:].decode(errors="replace")
                          if isinstance(exc.stderr, bytes) else str(exc.stderr)[-3000:])
        result["wall_s"] = time.perf_counter() - start
        results.append(result)
        if "error" in result:
            print(f"   FAILED: {result['error'][-1500:]}", flush=True)
    return results


def report(results: list[dict]) -> None:
    from benchmarks.common import table

    base = {(r["model"], row["batch"], row["mode"]): row["step_ms"] for r in results if r.get("tp") == 1
            for row in r.get("rows", [])}
    rows = []
    for r in results:
        for row in r.get("rows", []):
            ref = base.get((r["model"], row["batch"], row["mode"]))
            rows.append([r["model"], r["tp"], r.get("cudagraph_mode"), row["batch"], row["mode"], row["step_ms"],
                         row["tokens_per_s"], row.get("floor_ms", "-"), row.get("x_floor", "-"),
                         ref / row["step_ms"] if ref else "-"])
    print(table(["model", "TP", "graphs", "batch", "sched", "step ms", "tok/s", "floor ms/GPU", "x floor",
                 "speed-up vs TP=1"], rows))
    print(table(["model", "TP", "build s", "shutdown s", "worker exit codes", "errors"],
                [[r["model"], r.get("tp", "?"), r.get("build_s", "-"), r.get("shutdown_s", "-"),
                  r.get("worker_exit_codes", "-"), r.get("error", "") or "; ".join(r.get("errors", []))[:200]]
                 for r in results]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="model:tp pairs, one process each")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--capture-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--config-timeout", type=float, default=600)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: a single model:tp
    args = parser.parse_args()
    if args.one:
        result = run_one(args)
        Path(args.json).write_text(json.dumps(result))
        return
    from benchmarks.common import stamp

    print(stamp(), flush=True)
    results = run_all(args)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": stamp(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
