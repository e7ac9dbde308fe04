"""Do -O2's exact decode sizes pay? The default plan against the same plan without them, in one process.

Two arms on the same random weights, each a default Runtime built, measured and freed in turn:

- `exact`: default -O2 with `background_compile_sizes=(1, 2, 4, 8)` (`--exact-sizes`: -O2's plan on a GPU from
  issue 14 to issue 27), compiled after ready and waited for and swapped in
  (`finish_background_compiles`) before anything is timed;
- `range`: default -O2 with `background_compile_sizes=()`: every batch is served by the range artifact.

Each arm times decode steps at batch 1/8/64 (benchmarks.common.decode_step_seconds: the mean of 32
back-to-back steps, async scheduling as by default) and a short offline run (seeded random lengths, greedy,
EOS ignored, output tok/s). The arms alternate exact, range, range, exact, ... for `--rounds` builds each
while the time budget lasts, so the order's effects (clocks, allocator, caches) fall on both; the table gives
each arm's median and the ratio exact / range (< 1: the exact sizes win).

    python -m benchmarks.bench_exact_sizes --json $OUT/exact_sizes.json           # H200, llama3-8b: ~2 min warm
    python -m benchmarks.bench_exact_sizes --preset tiny-llama --device cpu --dtype fp32 --exact-sizes 2 4 \\
        --batches 1 2 --offline-requests 4 --rounds 1 --json /tmp/exact_sizes.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import traceback
from typing import Any

import torch

from benchmarks.common import decode_step_seconds, stamp, table
from kiln import Runtime, SamplingParams


def arm_options(arm: str, exact_sizes: list[int]) -> dict[str, Any]:
    return {"background_compile_sizes": () if arm == "range" else tuple(exact_sizes)}


def offline_tokens_per_s(rt: Runtime, requests: int, low: int, high: int) -> float:
    """Output tok/s of one generate over `requests` seeded random prompts (a short warm-up first)."""
    rng = random.Random(0)
    vocab = rt.engine.loaded.spec.vocab_size
    lens = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(requests)]
    rt.generate([[rng.randrange(vocab) for _ in range(16)] for _ in range(4)],
                SamplingParams(max_tokens=4, temperature=0.0))
    prompts = [[rng.randrange(vocab) for _ in range(i)] for i, _ in lens]
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in lens]
    _sync()
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    _sync()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"arm": arm}
    rt = None
    start = time.perf_counter()
    try:
        rt = Runtime(args.preset, device=args.device, dtype=args.dtype, load_format="dummy",
                     gpu_memory_utilization=args.gpu_memory_utilization, **arm_options(arm, args.exact_sizes))
        row["build_s"] = time.perf_counter() - start
        wait = time.perf_counter()
        row["background_finished"] = rt.finish_background_compiles(timeout=args.background_timeout_s)
        stats = rt.compile_stats
        row.update(background_wait_s=time.perf_counter() - wait, background_swapped=stats.background_swapped,
                   background_failed=stats.background_failed, cache_hits=stats.cache_hits,
                   inductor_compiles=stats.inductor_compiles, startup=dict(stats.startup),
                   exact_sizes=sorted(rt.engine.worker.compiled.backend.dispatcher.sizes),
                   kv_blocks=rt.engine.worker.num_blocks)  # equal in every build, or memory leaked between them
        for batch in args.batches:
            try:
                row[f"b{batch}_ms"] = decode_step_seconds(rt.engine, batch) * 1e3
            except Exception as exc:  # noqa: BLE001 - record it, measure the next batch
                row[f"b{batch}_error"] = f"{type(exc).__name__}: {exc}"
        if args.offline_requests:
            row["offline_tok_s"] = offline_tokens_per_s(rt, args.offline_requests, args.min_len, args.max_len)
    except Exception as exc:  # noqa: BLE001 - record the arm's failure, keep the other
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if rt is not None:
            rt.shutdown()
        del rt
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["total_s"] = time.perf_counter() - start
    print({k: v for k, v in row.items() if k != "startup"}, flush=True)
    return row


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), float)]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--exact-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="the exact arm's background sizes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--offline-requests", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="builds per arm (alternating: A B B A ...)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="no new build past this many seconds")
    parser.add_argument("--arm-estimate-s", type=float, default=40.0, help="a build is started only if this fits")
    parser.add_argument("--background-timeout-s", type=float, default=120.0)
    # below half the GPU: a build's KV cache must not depend on what the previous build may have left allocated
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    order = [arm for i in range(args.rounds) for arm in (("exact", "range") if i % 2 == 0 else ("range", "exact"))]
    rows: list[dict[str, Any]] = []
    report = {"args": vars(args), "rows": rows}
    for arm in order:
        if time.perf_counter() - start + args.arm_estimate_s > args.budget_s:
            print(f"budget spent: {arm} not built", flush=True)
            break
        rows.append(measure(arm, args))
        with open(args.json, "w") as f:  # after every arm: a run cut short keeps what it measured
            json.dump(report, f, indent=1)
    by_arm = {arm: [r for r in rows if r["arm"] == arm and "error" not in r] for arm in ("exact", "range")}
    lines = []
    for key, label in [(f"b{b}_ms", f"decode ms/step, batch {b}") for b in args.batches] + [
            ("offline_tok_s", "offline output tok/s")]:
        exact, range_ = _median(by_arm["exact"], key), _median(by_arm["range"], key)
        lines.append([label, exact if exact is not None else "-", range_ if range_ is not None else "-",
                      exact / range_ if exact and range_ else "-",
                      *(" ".join(f"{r[key]:.4g}" for r in by_arm[arm] if isinstance(r.get(key), float))
                        for arm in ("exact", "range"))])
    report.update(stamp=stamp(), total_s=time.perf_counter() - start, summary=lines)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(report["stamp"])
    print(f"{args.preset} {args.dtype} {args.device}: -O2 with its exact sizes (swapped in) vs without, one process; "
          f"medians of {len(by_arm['exact'])} / {len(by_arm['range'])} builds")
    print(table(["measure", "exact", "range", "exact / range", "exact runs", "range runs"], lines))
    print(table(["arm", "build s", "bg wait s", "swapped", "failed", "cache hits", "compiles", "exact sizes",
                 "KV blocks", "error"],
                [[r["arm"], r.get("build_s", "-"), r.get("background_wait_s", "-"), r.get("background_swapped", "-"),
                  r.get("background_failed", "-"), r.get("cache_hits", "-"), r.get("inductor_compiles", "-"),
                  r.get("exact_sizes", "-"), r.get("kv_blocks", "-"), r.get("error", "")] for r in rows]))


if __name__ == "__main__":
    main()
