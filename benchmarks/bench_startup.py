"""Start-up from a checkpoint on disk, as a user meets it: process start -> first token, cold and warm.

Writes a random bf16 checkpoint of a preset's shape once (sharded HF safetensors + index, config.json and
a tokenizer of the model's vocabulary size) to a local directory, then for each variant of Runtime options
starts two fresh processes from it: cold (empty KILN_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR,
CUDA_CACHE_PATH) and warm (the same directories again). Each reports the time from its process start to
the first token of a short generate, split by start-up phase (kiln/runtime/startup.py); the warm process
then times decode steps at batch 1/8/64. Every part is run and recorded even if another one fails.

    # H200, llama3-8b: ~30 s to write the checkpoint once, then ~2 min a variant (a cold and a warm start, decode)
    python -m benchmarks.bench_startup --variants default KILN_TRITON_KEY_MEMO=0 --json $OUT/startup.json
    # dry run on a CPU
    python -m benchmarks.bench_startup --preset tiny-llama --device cpu --workdir /tmp/kiln-startup \\
        --decode-batches 1 2 --json /tmp/kiln-startup/startup.json

A variant is `default` or `key=value[;key=value...]` of Runtime options (`compile_sizes=1,8,64`,
`compile_sizes=` for none, `level=3`) and environment variables (`KILN_KERNEL_WARMUP=0`); all variants share
one checkpoint. `--warm-repeats N` adds warm starts, the variants taking turns (an A/B of warm starts).
KILN_BENCH_SAMPLE=1 writes where each start's main thread spent its wall time (common.StackSampler) beside its
result; KILN_BENCH_PROFILE=1 does the same with cProfile (which slows a start by 20-30%).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import table

ROOT = Path(__file__).resolve().parents[1]
# issue 14: H200, commit 8b851ea, Runtime("llama3-8b", device="cuda", dtype="bf16"), default -O2
REFERENCE_TO_READY_S = {"cold": 190.6, "warm": 19.2}
REFERENCE_DECODE_MS = {1: 4.90, 8: 5.09, 64: 5.86}  # async scheduling
MARKER = "bench_checkpoint.json"
TUPLE_OPTIONS = ("compile_sizes", "compile_ranges", "cudagraph_capture_sizes", "cudagraph_piecewise_sizes", "passes",
                 "background_compile_sizes")


def _variant_parts(text: str) -> list[tuple[str, str]]:
    if text == "default":
        return []
    parts = []
    for part in filter(None, text.split(";")):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"variant part {part!r} is not key=value")
        parts.append((key, value))
    return parts


def variant_env(text: str) -> dict[str, str]:
    """The variant's environment variables: its parts whose key starts with KILN_ (`KILN_KERNEL_WARMUP=0`)."""
    return {key: value for key, value in _variant_parts(text) if key.startswith("KILN_")}


def parse_variant(text: str) -> dict[str, Any]:
    """`default` -> {}; `compile_sizes=1,8,64;level=3` -> {"compile_sizes": (1, 8, 64), "level": 3}; KILN_*
    parts are environment variables (variant_env), not Runtime options."""
    options: dict[str, Any] = {}
    for key, value in _variant_parts(text):
        if key.startswith("KILN_"):
            continue
        if key in TUPLE_OPTIONS or "," in value:
            options[key] = tuple(_scalar(v) for v in value.split(",") if v)
        else:
            options[key] = _scalar(value)
    return options


def _scalar(value: str) -> Any:
    try:
        return json.loads(value.lower() if value in ("True", "False") else value)
    except json.JSONDecodeError:
        return value


# -- child processes --------------------------------------------------------------------------------------


def child_write(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.synthetic_tokenizer import write_bpe_tokenizer
    from kiln.config import resolve_dtype
    from kiln.models.loader.presets import PRESETS
    from kiln.models.loader.random_checkpoint import write_random_checkpoint

    start = time.perf_counter()
    dtype = resolve_dtype(spec["dtype"], None, torch.device(spec["device"]))
    path = write_random_checkpoint(spec["preset"], spec["checkpoint"], dtype=dtype, device=spec["device"])
    weights = time.perf_counter() - start
    preset = PRESETS[spec["preset"]]
    write_bpe_tokenizer(path, preset["vocab_size"], bos_token_id=preset["bos_token_id"],
                              eos_token_id=preset["eos_token_id"])
    (path / MARKER).write_text(json.dumps(_checkpoint_identity(spec)))
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {"weights_s": weights, "total_s": time.perf_counter() - start, "bytes": size,
            "shards": len(list(path.glob("*.safetensors")))}


def child_start(spec: dict[str, Any]) -> dict[str, Any]:
    """One start: imports, Runtime(...), a one-token generate; then (warm) decode steps."""
    imports_start = time.time()
    import logging

    import torch

    from benchmarks.common import decode_step_seconds
    from kiln import Runtime, SamplingParams

    imported = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rt = Runtime(spec["checkpoint"], device=spec["device"], dtype=spec["dtype"],
                 attention_backend=spec["attention_backend"], **parse_variant(spec["variant"]))
    ready = time.time()
    prompt = "The first token after a start" if rt.tokenizer is not None else list(range(3, 19))
    rt.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first = time.time()
    stats = rt.compile_stats
    result: dict[str, Any] = {
        "to_first_token_s": first - spec["spawned_at"],
        "interpreter_s": imports_start - spec["spawned_at"], "imports_s": imported - imports_start,
        "runtime_s": ready - imported, "first_generate_s": first - ready,
        "phases": rt.startup_times.as_dict(), "summary": rt.startup_times.summary(),
        "load_config_s": rt.engine.loaded.config_seconds,  # of the load phase: reading config.json (json)
        # the whole load: materialising plus streaming the weights (on a GPU mostly beside trace and compile)
        "load_work_s": rt.engine.loaded.load_seconds,
        "dynamo_traces": stats.dynamo_traces, "inductor_compiles": stats.inductor_compiles,
        "cache_hits": stats.cache_hits, "compile_summary": stats.summary(),
    }
    worker = rt.engine.worker
    kernels = getattr(worker, "kernel_warmup", None)  # kiln's kernel warm-up (GPU, cold starts), beside compiling
    result["kernel_warmup_s"] = kernels.seconds if kernels is not None else None
    compilation = getattr(worker, "compilation", None)
    result["compile_sizes"] = list(getattr(compilation, "compile_sizes", None) or ())
    # the sizes left to the background (-O2 on a GPU): pending at the first token, then waited for and swapped
    # in before decode is timed, so decode is the tuned runtime's
    result["background_compile_sizes"] = list(getattr(compilation, "background_compile_sizes", None) or ())
    pending = stats.background_pending
    rt.finish_background_compiles()
    background = getattr(getattr(worker, "compiled", None), "background", None)
    result["background"] = {"pending_at_first_token": pending, "swapped_after_first_token_s": time.time() - first,
                            "compile_s": getattr(background, "seconds", 0.0), "swapped": stats.background_swapped,
                            "failed": stats.background_failed, "swap_s": stats.background_swap_seconds}
    pool = getattr(worker, "graph_pool", None)
    result["graph_captures"] = dict(pool.stats.captures) if pool is not None else {}
    if rt.engine.device.type == "cuda":
        result["gpu_peak_gib"] = torch.cuda.max_memory_allocated(rt.engine.device) / 2**30
    decode: dict[str, Any] = {}
    for mode in spec["decode_modes"]:
        rt.engine.async_scheduling = mode == "async"
        for batch in spec["decode_batches"]:
            try:
                decode[f"{mode}/{batch}"] = decode_step_seconds(rt.engine, batch) * 1e3
            except Exception as exc:  # a batch that does not fit is recorded, the others still run
                decode[f"{mode}/{batch}"] = f"{type(exc).__name__}: {exc}"
    result["decode_ms"] = decode
    return result


def _checkpoint_identity(spec: dict[str, Any]) -> dict[str, Any]:
    return {"preset": spec["preset"], "dtype": spec["dtype"], "format": 1}


# -- the driver --------------------------------------------------------------------------------------------


def run_child(kind: str, spec: dict[str, Any], env: dict[str, str], timeout: float, log: Path) -> dict[str, Any]:
    """Run `kind` in a fresh interpreter; its result, or {"error": ...} with the tail of its log."""
    if timeout < 5:
        return {"error": "skipped: the time budget is spent"}
    result_path = log.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    spec = {**spec, "result": str(result_path), "spawned_at": time.time()}
    argv = [sys.executable, "-m", "benchmarks.bench_startup", "--child", kind, json.dumps(spec)]
    wall = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - wall
    if rc == 0 and result_path.is_file():
        return {**json.loads(result_path.read_text()), "wall_s": wall}
    tail = log.read_text(errors="replace")[-3000:]
    return {"error": f"exit {rc} after {wall:.0f} s", "log_tail": tail, "wall_s": wall}


def child_env(caches: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("KILN_DISABLE_COMPILE_CACHE", None)
    # a user's install has bytecode; an image that forbids writing it makes every start compile every
    # module from source (the H200 image does: docs/startup.md)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if caches is not None:
        for name, sub in (("KILN_CACHE_DIR", "kiln"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                          ("TRITON_CACHE_DIR", "triton"), ("CUDA_CACHE_PATH", "cuda")):
            env[name] = str(caches / sub)
    return env


def profiled(run, spec: dict[str, Any]) -> dict[str, Any]:
    """KILN_BENCH_PROFILE=1: run a child under cProfile (main thread) and write the 60 costliest calls by
    cumulative time beside its result, as <result>.profile.txt: where a start's seconds go."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    result = profiler.runcall(run, spec)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    Path(spec["result"]).with_suffix(".profile.txt").write_text(text.getvalue())
    return result


def sampled(run, spec: dict[str, Any]) -> dict[str, Any]:
    """KILN_BENCH_SAMPLE=1: sample the main thread's stack every 5 ms (common.StackSampler: waits included, ~1%
    overhead, unlike cProfile) and write the report beside the result, as <result>.sample.txt."""
    from benchmarks.common import StackSampler

    with StackSampler() as sampler:
        result = run(spec)
    Path(spec["result"]).with_suffix(".sample.txt").write_text(sampler.report())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--workdir", default="/tmp/kiln-bench-startup", help="checkpoint and caches (local disk)")
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--decode-modes", nargs="*", choices=["async", "sync"], default=["async"])
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock bound of the whole run")
    parser.add_argument("--start-timeout-s", type=float, default=320.0, help="bound of one start")
    parser.add_argument("--warm-repeats", type=int, default=1,
                        help="warm starts per variant; after the first, the variants take turns")
    parser.add_argument("--sample-warm", action="store_true",
                        help="one more warm start per variant, its main thread sampled (KILN_BENCH_SAMPLE)")
    parser.add_argument("--json", help="where the report goes (required)")
    parser.add_argument("--child", choices=["write", "start"], help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.spec)
        run = child_write if args.child == "write" else child_start
        if os.environ.get("KILN_BENCH_PROFILE"):
            result = profiled(run, spec)
        elif os.environ.get("KILN_BENCH_SAMPLE"):
            result = sampled(run, spec)
        else:
            result = run(spec)
        Path(spec["result"]).write_text(json.dumps(result, indent=1))
        return
    if not args.json:
        parser.error("--json is required")
    for variant in args.variants:
        parse_variant(variant)  # a typo fails now, not after the checkpoint is written
    drive(args)


def drive(args: argparse.Namespace) -> None:
    from benchmarks.common import stamp

    deadline = time.perf_counter() + args.budget_s
    workdir = Path(args.workdir)
    out_path = Path(args.json)
    logs = out_path.with_name(out_path.stem + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"{args.preset}-{args.dtype}"
    base = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "checkpoint": str(checkpoint),
            "attention_backend": args.attention_backend}
    # stamped at the end: stamp() initialises CUDA, which must not hold GPU memory while the children run
    report: dict[str, Any] = {"stamp": None, "args": vars(args), "reference_to_ready_s": REFERENCE_TO_READY_S,
                              "reference_decode_ms": REFERENCE_DECODE_MS, "variants": {}}

    def save() -> None:  # after every part: a run cut short still leaves what it measured
        out_path.write_text(json.dumps(report, indent=1))

    marker = checkpoint / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == _checkpoint_identity(base):
        report["checkpoint"] = {"reused": True}
    else:
        print(f"writing a random {args.preset} checkpoint to {checkpoint} ...", flush=True)
        report["checkpoint"] = run_child("write", base, child_env(None), deadline - time.perf_counter(),
                                         logs / "write.log")
    print(f"checkpoint: {report['checkpoint']}", flush=True)
    save()
    if "error" in report["checkpoint"]:
        print(f"checkpoint failed: {report['checkpoint']['error']}\n{report['checkpoint']['log_tail']}")
        return

    def start_one(variant: str, start: str, sample: bool = False) -> None:
        """One start of `variant` on its own cache directory (emptied before its cold start)."""
        slug = "".join(c if c.isalnum() else "_" for c in variant)
        caches = workdir / "caches" / slug
        if start == "cold":
            shutil.rmtree(caches, ignore_errors=True)
            caches.mkdir(parents=True)
        spec = {**base, "variant": variant, "decode_modes": args.decode_modes,
                "decode_batches": args.decode_batches if start == "warm" else []}
        timeout = min(args.start_timeout_s, deadline - time.perf_counter())
        print(f"{variant}: {start} start ...", flush=True)
        runs = report["variants"][variant]
        env = {**child_env(caches), **variant_env(variant), **({"KILN_BENCH_SAMPLE": "1"} if sample else {})}
        runs[start] = run_child("start", spec, env, timeout, logs / f"{slug}-{start}.log")
        print(f"{variant}: {start}: " + (runs[start].get("summary") or runs[start]["error"]), flush=True)
        save()

    for variant in args.variants:
        report["variants"][variant] = {}
        for start in ("cold", "warm"):
            start_one(variant, start)
    # more warm starts, the variants taking turns: an A/B of warm starts with the order effects spread
    for round_ in range(2, args.warm_repeats + 1):
        for variant in args.variants:
            start_one(variant, f"warm{round_}")
    if args.sample_warm:  # not timed with the others: the sampler's thread takes the GIL every 5 ms
        for variant in args.variants:
            start_one(variant, "warm-sampled", sample=True)
    report["stamp"] = stamp()
    save()
    print_report(report)


def _background_cells(background: dict[str, Any]) -> list[Any]:
    """Background compiles: pending at the first token, swapped in how long after it, the swap's own time."""
    if not background.get("pending_at_first_token"):
        return [0, "", ""]
    return [background["pending_at_first_token"], round(background["swapped_after_first_token_s"], 1),
            round(background["swap_s"], 2)]


def print_report(report: dict[str, Any]) -> None:
    phases = ("load", "tokenizer", "trace", "compile", "kv", "capture", "other")  # load includes "config"
    headers = ["variant", "start", "to 1st token s", "ref / this", "imports", "config", *phases, "1st gen",
               "compiles", "cache hits", "bg pending", "bg in after 1st s", "bg swap s"]
    rows = []
    for variant, runs in report["variants"].items():
        for start, r in runs.items():
            if "error" in r:
                rows.append([variant, start, r["error"]] + [""] * (len(headers) - 3))
                continue
            ref = REFERENCE_TO_READY_S["cold" if start == "cold" else "warm"]
            rows.append([variant, start, r["to_first_token_s"], ref / r["to_first_token_s"],
                         r["interpreter_s"] + r["imports_s"], round(r["load_config_s"], 2)]
                        + [round(r["phases"][p], 2) for p in phases]
                        + [r["first_generate_s"], r["inductor_compiles"], r["cache_hits"]]
                        + _background_cells(r.get("background") or {}))
    print(report["stamp"])
    print(table(headers, rows))
    ref = REFERENCE_TO_READY_S
    print(f"reference (issue 14, to ready, not to first token): cold {ref['cold']} s, warm {ref['warm']} s")
    decode_rows = []
    for variant, runs in report["variants"].items():
        for key, ms in runs.get("warm", {}).get("decode_ms", {}).items():
            mode, batch = key.split("/")
            ref = REFERENCE_DECODE_MS.get(int(batch)) if mode == "async" else None
            ok = isinstance(ms, float)
            decode_rows.append([variant, mode, batch, ms if ok else ms[:60], ref or "",
                                ms / ref if ok and ref else ""])
    if decode_rows:
        print(table(["variant", "mode", "batch", "step ms", "ref ms", "this / ref"], decode_rows))


if __name__ == "__main__":
    main()
