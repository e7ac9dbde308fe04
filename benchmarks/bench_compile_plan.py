"""Which exact sizes pay: decode step time with range-compiled pieces against exact-size-compiled pieces.

In one process, on the same random weights, each configuration builds a Runtime (cold compile cache,
-O2, CUDA graphs as the runtime serves: FULL for uniform decode, PIECEWISE otherwise) whose CUDA-graph
capture sizes are the decode batches, and times the median engine step while `batch` requests decode:

- `range`: no exact size; every capture size is served, and captured, from the general range artifact;
- `exact`: every decode batch is also compiled as an exact size (what -O2 did before issue 14);
- `default`: the -O2 plan of this commit (on a GPU, the range alone since issue 27).

The table gives each batch's step time per configuration, the ratio exact / range (< 1: the exact size
wins), which artifact the dispatcher serves the batch from, and the start-up and compile figures of each
configuration (exact compiles 9 extra sizes per distinct piece, in parallel worker processes). Every part
is caught and recorded on failure, and all rows go to the JSON file given.

    python -m benchmarks.bench_compile_plan --json compile_plan.json                  # H200: ~3 min
    python -m benchmarks.bench_compile_plan --preset tiny-llama --device cpu --dtype fp32 \\
        --backend torch --batches 1 2 4 --steps 3 --json /tmp/plan.json               # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any

import torch

from benchmarks.common import stamp, start_decoding, table
from kiln import Runtime

PROMPT_LEN = 128
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_ms(rt: Runtime, batch: int, steps: int, device: str) -> float:
    """Median engine step while `batch` requests of PROMPT_LEN-token prompts decode."""
    engine = rt.engine
    start_decoding(engine, batch, PROMPT_LEN, max_tokens=steps + 4)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def compile_sizes_of(config: str, batches: tuple[int, ...]) -> tuple[int, ...] | None:
    if config == "range":
        return ()
    if config == "exact":
        return batches
    return None  # default: the level's plan


def measure(config: str, args: argparse.Namespace) -> dict[str, Any]:
    batches = tuple(sorted(set(args.batches)))
    row: dict[str, Any] = {"config": config}
    start = time.perf_counter()
    rt = None
    try:
        with tempfile.TemporaryDirectory(prefix="kiln_plan_cache_") as cache_dir:  # cold, like a first start
            os.environ["KILN_CACHE_DIR"] = cache_dir
            os.environ.pop("KILN_DISABLE_COMPILE_CACHE", None)
            rt = Runtime(args.preset, device=args.device, dtype=args.dtype, load_format="dummy", level=2,
                         attention_backend=args.backend, max_num_seqs=max(batches), enable_prefix_caching=False,
                         compile_sizes=compile_sizes_of(config, batches),
                         cudagraph_capture_sizes=batches if args.device == "cuda" else None,
                         gpu_memory_utilization=args.gpu_memory_utilization, compile_workers=args.compile_workers)
            stats = rt.compile_stats
            row.update(startup_s=round(time.perf_counter() - start, 1),
                       compile_phase_s=round(stats.warmup_seconds, 1), inductor_compiles=stats.inductor_compiles,
                       compile_workers=stats.compile_workers, worker_compiles=stats.worker_compiles,
                       compile_sizes=list(rt.engine.worker.compilation.compile_sizes))
            runner = next(iter(rt.engine.worker.compiled.capture.runners.values()))
            for batch in batches:
                graphs = getattr(rt.engine.runner, "graphs", None)  # decode batches: their mode's padding
                key = runner.dispatcher.select(graphs.padded_size(batch, graphs.mode_for(batch, True))
                                               if graphs else batch)
                row[f"b{batch}_served_by"] = "exact" if key.exact else "range"
                try:
                    replays = dict(rt.engine.graph_replays)
                    row[f"b{batch}_ms"] = decode_ms(rt, batch, args.steps, args.device)
                    after = rt.engine.graph_replays
                    row[f"b{batch}_graph_replays"] = {k: after[k] - replays.get(k, 0) for k in after}
                except Exception as exc:  # noqa: BLE001 - record and go on with the next batch
                    row[f"b{batch}_error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
    except Exception as exc:  # noqa: BLE001 - record the configuration's failure, keep the others
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        del rt
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--configs", nargs="+", default=["range", "exact", "default"],
                        choices=["range", "exact", "default"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile-workers", type=int, default=None, help="default: from the host's cores")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = [measure(config, args) for config in args.configs]
    by_config = {r["config"]: r for r in rows}
    ms_of = {c: {b: by_config[c].get(f"b{b}_ms") for b in args.batches} for c in by_config}
    table_rows = []
    for b in args.batches:
        line: list[Any] = [b]
        for c in args.configs:
            ms = ms_of[c][b]
            line += [ms if ms is not None else "fail", by_config[c].get(f"b{b}_served_by", "?")]
        rng, exact = ms_of.get("range", {}).get(b), ms_of.get("exact", {}).get(b)
        line.append(exact / rng if rng and exact else "-")
        table_rows.append(line)
    headers = ["batch"] + [h for c in args.configs for h in (f"{c} ms", f"{c} serves")] + ["exact/range"]
    print(stamp())
    print(f"{args.preset} {args.dtype} {args.device} {args.backend}: decode step ms (median of {args.steps})")
    print(table(headers, table_rows))
    print(table(["config", "start-up s", "compile phase s", "Inductor compiles", "workers (in worker)", "error"],
                [[r["config"], r.get("startup_s", "-"), r.get("compile_phase_s", "-"), r.get("inductor_compiles", "-"),
                  f"{r.get('compile_workers', '-')} ({r.get('worker_compiles', '-')})", r.get("error", "")]
                 for r in rows]))
    print(f"total {time.perf_counter() - start:.0f} s")
    with open(args.json, "w") as f:
        json.dump({"stamp": stamp(), "preset": args.preset, "device": args.device, "backend": args.backend,
                   "steps": args.steps, "rows": rows, "total_s": round(time.perf_counter() - start, 1)}, f, indent=1)


if __name__ == "__main__":
    main()
