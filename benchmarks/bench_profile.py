"""Where a decode step's time goes, on the GPU: torch.profiler over steady-state decode steps at default settings.

For each configuration (model, TP size, quantization, batch) it reports, per step: the wall time of the step
(timed without the profiler), the time the GPU of rank 0 was busy (union of its kernel intervals), the
idle remainder and the gaps that make it up (by the kernel that ends each), and the kernel time by kind (GEMM,
attention, all-reduce, Inductor/Triton element-wise, copies, other) with the top kernels, both as span sums and
as the time each adds to the busy chain (`critical_us`: what is left of a kernel once spans overlap under PDL).
Idle time is host or peer waiting; an all-reduce kernel that runs long is waiting for the peer rank. Only rank 0 is
profiled.

    python -m benchmarks.bench_profile --configs llama3-8b:1:bf16 llama3-8b:2:bf16 llama3-8b:1:fp8 \
        --batches 1 64 --json prof.json [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import time
import traceback
from typing import Any

import torch

from benchmarks.common import start_decoding, table

KINDS = (  # first match wins
    ("allreduce", re.compile(r"nccl|all_?reduce|one_shot|two_shot|symm|multimem|cross_device", re.I)),
    ("attention", re.compile(r"attention|attn|flash|paged|page_indices|reshape_and_cache", re.I)),
    ("gemm", re.compile(r"gemm|gemv|xmma|cutlass|nvjet|scaled_mm|cublas|wgmma|sm90|splitk|matmul", re.I)),
    ("elementwise", re.compile(r"^triton_|^triton|elementwise|vectorized|reduce_kernel|unrolled", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


# Inductor's generated kernels are element-wise/reductions whatever ops their names list ("..._dense_gemm_mul_silu")
INDUCTOR_KERNEL = re.compile(r"^triton_(poi|red|per)_")


def kind_of(name: str) -> str:
    if INDUCTOR_KERNEL.match(name):
        return "elementwise"
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def critical_us(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """The busy time each kernel adds to one stream's chain, summed by name (`charges`)."""
    charged: dict[str, float] = {}
    for name, busy in charges(kernels):
        charged[name] = charged.get(name, 0.0) + busy
    return charged


def charges(kernels: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """(name, us) of each kernel in completion order: the busy time it adds to one stream's chain. With programmatic
    dependent launch a kernel's span starts before its predecessor ends (its programs wait on the device), so spans
    overlap and their sum exceeds the busy time. Here every busy instant is charged to the next kernel to complete:
    a kernel gets the busy time between the previous completion and its own. The charges sum to the busy time."""
    merged: list[list[float]] = []
    for start, stop in sorted((k[0], k[1]) for k in kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    charged: list[tuple[str, float]] = []
    end, j = float("-inf"), 0
    for _, stop, name in sorted(kernels, key=lambda k: k[1]):
        busy = 0.0
        while j < len(merged) and merged[j][0] < stop:
            lo, hi = max(merged[j][0], end), min(merged[j][1], stop)
            busy += max(0.0, hi - lo)
            if merged[j][1] > stop:
                break
            j += 1
        charged.append((name, busy))
        end = max(end, stop)
    return charged


def layer_chain(charged: list[tuple[str, float]], repeats: int = 3, longest: int = 64) -> list[dict[str, Any]]:
    """One decoder layer's kernels in completion order (from wherever the layer pattern is first met after the
    profile's middle), each with its charge averaged over `repeats` layers: the shortest period of kernel names that
    repeats `repeats` times. Empty when no period up to `longest` kernels repeats."""
    names = [name for name, _ in charged]
    mid = len(names) // 2
    for period in range(2, longest + 1):
        for start in range(mid, mid + longest):
            window = names[start: start + repeats * period]
            if len(window) == repeats * period and all(window[i] == window[i + period]
                                                       for i in range(len(window) - period)):
                return [{"kernel": names[start + i][:70],
                         "us": sum(charged[start + i + r * period][1] for r in range(repeats)) / repeats}
                        for i in range(period)]
    return []


def gaps(kernels: list[tuple[float, float, str]], steps: int, min_us: float = 2.0) -> dict[str, Any]:
    """Where the GPU waits: the idle stretches between kernels (union of intervals) longer than `min_us`, summed
    per step by the kernel that ends each one (the work that came late) and by the one before it."""
    after: dict[str, float] = {}
    before: dict[str, float] = {}
    count, end, last = 0, None, ""
    for start, stop, name in sorted(kernels):
        if end is not None and start - end > min_us:
            count += 1
            after[name[:70]] = after.get(name[:70], 0.0) + (start - end)
            before[last[:70]] = before.get(last[:70], 0.0) + (start - end)
        if end is None or stop > end:
            end, last = stop, name

    def top(d: dict[str, float]) -> list[dict[str, Any]]:
        return [{"kernel": k, "us_per_step": v / steps} for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:8]]

    return {"per_step": count / steps, "us_per_step": sum(after.values()) / steps,
            "by_next_kernel": top(after), "by_previous_kernel": top(before)}


def host_profile(engine: Any, steps: int, sync: Any) -> dict[str, list[dict[str, Any]]]:
    """cProfile of `steps` engine steps on rank 0's host: the functions with the most own time, and kiln's
    functions with the most time including callees, per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    prof.disable()
    entries = pstats.Stats(prof).stats.items()  # type: ignore[attr-defined]

    def rows(items: list, n: int) -> list[dict[str, Any]]:
        return [{"fn": f"{os.path.basename(path)}:{line}:{name}", "calls": calls / steps,
                 "own_ms": own / steps * 1e3, "cum_ms": cum / steps * 1e3}
                for (path, line, name), (_, calls, own, cum, _) in items[:n]]

    own = sorted(entries, key=lambda kv: -kv[1][2])
    cum = sorted((kv for kv in entries if "/kiln/" in kv[0][0]), key=lambda kv: -kv[1][3])
    return {"by_own_time": rows(own, 25), "kiln_by_cumulative": rows(cum, 25)}


def profile_steps(engine: Any, steps: int, sync: Any, trace_path: str | None, host: bool = False) -> dict[str, Any]:
    """Wall time of `steps` engine steps, then the same number again under the profiler: rank 0's kernel time
    by kind and by name, and how much of the step its GPU was busy; with `host`, a cProfile of rank 0's host
    over another `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # not timed: a batch's first steps pay one-off costs (the first replay of its graph)
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    host_rows = host_profile(engine, steps, sync) if host else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + us
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]  # a layer's kernels, all of them at decode
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps / 1e3
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in kernels]
    idle = gaps(spans, steps)
    critical = critical_us(spans)
    critical_by_kind: dict[str, float] = {}
    for name, us in critical.items():
        critical_by_kind[kind_of(name)] = critical_by_kind.get(kind_of(name), 0.0) + us
    if trace_path:
        prof.export_chrome_trace(trace_path)
        with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace_path)
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "idle_ms": step_ms - busy, "host": host_rows,
            "kernels_per_step": len(kernels) / steps, "gaps": idle, "layer_chain": layer_chain(charges(spans)),
            "by_kind_ms": {k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "critical_by_kind_ms": {k: v / steps / 1e3 for k, v in sorted(critical_by_kind.items(),
                                                                           key=lambda kv: -kv[1])},
            "top": [{"name": n[:90], "ms_per_step": t / steps / 1e3, "critical_ms_per_step": critical[n] / steps / 1e3,
                     "per_step": c / steps} for n, (t, c) in top]}


def profile_config(model: str, tp: int, quant: str, batches: list[int], steps: int, trace_dir: str | None,
                   device: str = "cuda", offline_requests: int = 0, host: bool = False,
                   offline_at: tuple[int, ...] = ()) -> dict:
    """With `offline_requests`, the offline workload (lengths U(100, 1024)) profiled at the runtime's default
    capture sizes, once after each step count in `offline_at` (default 4 x steps: past the first prefills;
    2 profiles the steps that carry prefill chunks); then decode at each batch size (graphs captured at
    exactly those sizes when there is no offline part)."""
    from benchmarks.common import throughput_workload
    from kiln import Runtime, SamplingParams

    on_gpu = device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    options: dict[str, Any] = {}
    if on_gpu and not offline_requests:
        options["cudagraph_capture_sizes"] = tuple(sorted(set(batches)))
    start = time.perf_counter()
    rt = Runtime(model, device=device, dtype="bf16" if on_gpu else "fp32", load_format="dummy",
                 tensor_parallel_size=tp, quantization=None if quant == "bf16" else quant,
                 attention_backend="triton" if on_gpu else "torch", **options)
    result: dict[str, Any] = {"model": model, "tp": tp, "quant": quant, "rows": [],
                              "build_s": round(time.perf_counter() - start, 1)}
    engine = rt.engine
    slug = f"{model}-tp{tp}-{quant}"
    if offline_requests:
        rng, lens = throughput_workload(offline_requests)
        vocab = engine.loaded.spec.vocab_size
        for i, o in lens:
            engine.add_request([rng.randrange(vocab) for _ in range(i)],
                               SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
        done = 0
        for at in offline_at or (4 * steps,):
            for _ in range(max(0, at - done)):
                engine.step()
            done = max(done, at)
            trace = trace_dir and os.path.join(trace_dir, f"{slug}-offline{at}.json")
            row = {"batch": f"offline{offline_requests}@{at}", "running": len(engine.scheduler.running),
                   "waiting": len(engine.scheduler.waiting), **profile_steps(engine, steps, sync, trace, host)}
            done += 2 * steps + 2 + (steps if host else 0)
            result["rows"].append(row)
            print(json.dumps(row, indent=1), flush=True)
        while engine.has_unfinished():
            engine.step()
    for batch in batches:
        start_decoding(engine, batch, 128, max_tokens=(3 if host else 2) * steps + 12)
        trace = trace_dir and os.path.join(trace_dir, f"{slug}-b{batch}.json")
        row = {"batch": batch, **profile_steps(engine, steps, sync, trace, host)}
        while engine.has_unfinished():
            engine.step()
        result["rows"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    rt.engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["llama3-8b:1:bf16"], help="model:tp:quant (bf16 or fp8)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no kernels to attribute)")
    parser.add_argument("--offline-requests", type=int, default=0,
                        help="profile the offline workload of this many requests instead of decode batches")
    parser.add_argument("--offline-at", type=int, nargs="+", default=[],
                        help="profile the offline workload after these step counts (2: prefill-carrying steps)")
    parser.add_argument("--host", action="store_true", help="also cProfile rank 0's host over the decode steps")
    args = parser.parse_args()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    results = []
    for spec in args.configs:
        model, tp, quant = spec.split(":")
        try:
            results.append(profile_config(model, int(tp), quant, args.batches, args.steps, args.trace_dir,
                                          args.device, args.offline_requests, args.host,
                                          tuple(args.offline_at)))
        except Exception as exc:  # noqa: BLE001 - one failed configuration must not lose the others
            traceback.print_exc()  # where it failed: the one-line record below does not say
            results.append({"config": spec, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(results[-1], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    # by kind: the busy time each kind adds to the chain (critical_us), which sums to the busy time under PDL too
    rows = [[f"{r['model']} tp{r['tp']} {r['quant']}", row["batch"], row["step_ms"], row["gpu_busy_ms"], row["idle_ms"],
             *(row["critical_by_kind_ms"].get(k, 0.0) for k, _ in KINDS), row["critical_by_kind_ms"].get("other", 0.0)]
            for r in results if "rows" in r for row in r["rows"]]
    print(table(["config", "batch", "step ms", "GPU busy", "idle", *(k for k, _ in KINDS), "other"], rows))
    for r in results:  # one layer's kernels in order, each with the busy time it adds (us)
        for row in r.get("rows", []):
            chain = " -> ".join(f"{k['kernel'][:40]} {k['us']:.1f}" for k in row.get("layer_chain", []))
            print(f"{r['model']} tp{r['tp']} {r['quant']} batch {row['batch']} layer: {chain or '(no repeat found)'}")


if __name__ == "__main__":
    main()
