"""The GPU benchmark (H200 reference): decode latency, offline throughput, each backend x graph mode.

Random bf16 weights at real shapes (presets), greedy, EOS ignored. Every number is printed next to a
floor or baseline measured in the same run: the copy bandwidth and matmul rate of this GPU, and
transformers' eager `generate` on the same shapes.

    python -m benchmarks.bench_gpu decode --defaults --backend triton --models llama3-8b smollm2-135m \
        --async-scheduling on --hf                                   # decode at default settings, with transformers
    python -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 --hf --hf-requests 64 \
        --hf-batch 64 --hf-max-seconds 90        # the offline workload at default settings, with transformers
    python -m benchmarks.bench_gpu matrix --model smollm2-135m       # every backend x graph mode
    python -m benchmarks.bench_gpu prefix-cache --device cpu         # prefix caching off vs on (embedded model)
    python -m benchmarks.bench_gpu throughput --defaults --device cpu --model tiny-llama --requests 4 \
        --max-len 32 --backend torch                                 # CPU dry run

Tensor-parallel decode: bench_tp.py; a step's kernels by kind: bench_profile.py.

Writes a JSON of all rows to --json when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import traceback
from dataclasses import asdict

import torch

from benchmarks.common import (
    PROMPT_LEN,
    Ceilings,
    decode_floor_seconds,
    decode_step_seconds,
    decode_step_timing,
    measure_ceilings,
    no_ceilings,
    offline_requests,
    stamp,
    sync,
    table,
    throughput_workload,
    timed_generate,
    warm_up,
    weight_bytes,
)
from kiln import Runtime, SamplingParams
from kiln.entrypoints.cli.main import parse_inductor_option

ASYNC_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
COMPILE_OPTIONS: dict = {}  # from the command line: capture / compile sizes shared by every runtime built


def make_runtime(model: str, **kwargs) -> tuple[Runtime, float]:
    start = time.perf_counter()
    for key, value in COMPILE_OPTIONS.items():
        kwargs.setdefault(key, value)
    kwargs.setdefault("max_num_seqs", 256)
    kwargs.setdefault("max_num_batched_tokens", 4096)
    kwargs.setdefault("gpu_memory_utilization", 0.85)
    rt = Runtime(model, device="cuda", dtype="bf16", load_format="dummy", **kwargs)
    return rt, time.perf_counter() - start


def hf_model(model: str, device: str = "cuda") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from kiln.models.loader.presets import preset_config

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32  # the dtype kiln's defaults pick there
    with torch.device(device):
        return AutoModelForCausalLM.from_config(preset_config(model), dtype=dtype).eval()


def hf_decode_tokens_per_s(hf: torch.nn.Module, batch: int, new_tokens: int = 32) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (batch, PROMPT_LEN), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def cmd_decode(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    rows = []
    for model in args.models:
        rt, build = default_runtime(args, model) if args.defaults else make_runtime(
            model, level=args.level, attention_backend=args.backend)
        rt.finish_background_compiles()  # -O2 on a GPU compiles its exact decode sizes after ready: wait for them
        print(f"{model}: built in {build:.1f}s, backend {rt.engine.backend.name}", flush=True)
        steps = {}
        for overlap in ASYNC_MODES[args.async_scheduling]:
            rt.engine.async_scheduling = overlap  # switchable between steps: an A/B on one compiled runtime
            steps.update({(batch, overlap): decode_step_timing(rt.engine, batch) for batch in args.batches})
        floors = {batch: decode_floor_seconds(rt, batch, ceil) for batch in args.batches}
        del rt
        torch.cuda.empty_cache()
        hf_net = hf_model(model) if args.hf else None
        for batch in args.batches:
            bytes_floor, compute_floor = floors[batch]
            hf = hf_decode_tokens_per_s(hf_net, batch) if hf_net is not None else float("nan")
            for overlap in ASYNC_MODES[args.async_scheduling]:
                step, host = steps[batch, overlap]
                rows.append(dict(model=model, batch=batch, backend=args.backend, async_scheduling=overlap,
                                 step_ms=step * 1e3, host_ms=host * 1e3, tokens_per_s=batch / step,
                                 floor_ms=max(bytes_floor, compute_floor) * 1e3,
                                 x_floor=step / max(bytes_floor, compute_floor), hf_tokens_per_s=hf,
                                 x_hf=(batch / step) / hf if hf == hf else float("nan")))
                print(rows[-1], flush=True)
        del hf_net
        torch.cuda.empty_cache()
    print(table(["model", "batch", "backend", "async", "step ms", "host ms", "tok/s", "floor ms", "x floor", "HF tok/s",
                 "x HF"],
                [[r["model"], r["batch"], r["backend"], r["async_scheduling"], r["step_ms"], r["host_ms"],
                  r["tokens_per_s"], r["floor_ms"], r["x_floor"], r["hf_tokens_per_s"], r["x_hf"]] for r in rows]))
    return rows


def cmd_matrix(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    rows = []
    for backend in args.backends:
        for mode in args.modes:
            level = 0 if mode == "EAGER" else args.level
            kwargs = dict(level=level, attention_backend=backend)
            if level:
                kwargs["cudagraph_mode"] = mode
            try:
                rt, build = make_runtime(args.model, **kwargs)
            except Exception as exc:  # a backend missing on this machine is a row, not a crash
                rows.append(dict(backend=backend, mode=mode, batch="-", step_ms=float("nan"), note=str(exc)[:60]))
                continue
            for batch in args.batches:
                step = decode_step_seconds(rt.engine, batch)
                floor = max(decode_floor_seconds(rt, batch, ceil))
                rows.append(dict(backend=backend, mode=mode, batch=batch, step_ms=step * 1e3,
                                 x_floor=step / floor, note=f"build {build:.0f}s"))
                print(rows[-1], flush=True)
            del rt
            torch.cuda.empty_cache()
    print(table(["backend", "graph mode", "batch", "step ms", "x floor", "note"],
                [[r["backend"], r["mode"], r["batch"], r["step_ms"], r.get("x_floor", float("nan")), r["note"]]
                 for r in rows]))
    return rows


def default_runtime(args: argparse.Namespace, model: str) -> tuple[Runtime, float]:
    """The runtime a user gets without flags: only the model, dummy weights, device and attention backend
    (and --compile-sizes / --max-num-batched-tokens when given) are set; the rest is Runtime's default."""
    kwargs = {} if args.compile_sizes is None else {"compile_sizes": tuple(args.compile_sizes)}
    if getattr(args, "max_num_batched_tokens", None) is not None:  # an A/B of the token budget (8192 vs 2048)
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "compile_ranges", None):  # an A/B of the compile plan: extra range end points
        kwargs["compile_ranges"] = tuple(args.compile_ranges)
    if getattr(args, "quantization", None):  # an FP8 model at its defaults
        kwargs["quantization"] = args.quantization
    if getattr(args, "inductor_option", None):  # an A/B of an Inductor setting (parsed as `kiln` parses it)
        kwargs["inductor_options"] = dict(args.inductor_option)
    start = time.perf_counter()
    rt = Runtime(model, device=getattr(args, "device", "cuda"), load_format="dummy", attention_backend=args.backend,
                 **kwargs)
    return rt, time.perf_counter() - start


def cmd_throughput(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    """kiln on every request, then (--hf) kiln and transformers on the same first --hf-requests of them.

    Each part records its failure instead of ending the run; the kiln row prints before the slow baseline."""
    rng, lens = throughput_workload(args.requests, args.min_len, args.max_len)
    if args.hf_only:  # the baseline alone (e.g. on a second GPU while kiln runs on the first)
        row = dict(model=args.model, requests=args.requests, hf_batch=args.hf_batch,
                   hf_output_tokens_per_s=hf_throughput(args.model, lens, args.hf_batch, args.device)[0])
        print(table(list(row), [list(row.values())]))
        return [row]
    subset = min(args.hf_requests or args.requests, args.requests)
    row: dict = dict(model=args.model, requests=args.requests, settings="defaults" if args.defaults else "tuned",
                     quantization=args.quantization or "none")
    rt = None
    try:
        rt, build = default_runtime(args, args.model) if args.defaults else make_runtime(
            args.model, level=args.level, attention_backend=args.backend)
        sched = rt.engine.config.scheduler
        row.update(build_s=build, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                   async_scheduling=rt.engine.async_scheduling, level=rt.engine.config.compilation.level,
                   backend=rt.engine.backend.name)
        print(f"built in {build:.1f}s: {row}", flush=True)
        start = time.perf_counter()  # -O2 on a GPU compiles its exact decode sizes after ready: time them in
        rt.finish_background_compiles()
        row.update(background_wait_s=time.perf_counter() - start,
                   inductor_options=dict(rt.engine.worker.compilation.inductor_options))  # resolved: with defaults
        warm_up(rt, lens, rng)
        prompts, params = offline_requests(rt, lens, rng)
        runs = []
        for i in range(args.repeats):  # the workload again on the same runtime: the spread between runs
            if i:  # new prompt tokens, the same lengths: a repeated prompt would be a prefix-cache hit
                prompts, params = offline_requests(rt, lens, rng)
            steps_before = rt.stats()["steps"]
            timeline: dict = {}
            seconds, out_tokens = timed_generate(rt, prompts, params, timeline)
            runs.append((out_tokens / seconds, seconds, rt.stats()["steps"] - steps_before, timeline))
            print(f"run {i + 1}: {runs[-1][0]:.0f} output tok/s", flush=True)
        # the headline is the median run (of two, the slower)
        tok_s, seconds, steps, timeline = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]
        row.update(seconds=seconds, output_tokens=out_tokens, output_tokens_per_s=tok_s, steps=steps,
                   preemptions=rt.engine.scheduler.num_preemptions, timeline=timeline,
                   runs_output_tokens_per_s=[round(r[0], 1) for r in runs], runs_timelines=[r[3] for r in runs])
        if ceil.copy_bytes_per_s == ceil.copy_bytes_per_s:  # a roofline needs the GPU's measured ceilings
            row.update(roofline(rt, lens, steps, ceil, seconds))
        print(row, flush=True)  # before the (slow) baseline, so a time-out still leaves kiln's number
        if args.hf and subset < args.requests:  # the baseline's workload, on the same warm runtime
            # new prompt tokens: the ones above are in the prefix cache now (their prefill would be skipped)
            prompts, params = offline_requests(rt, lens[:subset], rng)
            sub_seconds, sub_tokens = timed_generate(rt, prompts, params)
            row.update(subset_requests=subset, subset_output_tokens_per_s=sub_tokens / sub_seconds)
    except Exception as exc:  # recorded, not fatal: the baseline still runs
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:  # free the KV cache and weights for the baseline: compiled code and CUDA graphs hold them too
        del rt
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.hf:
        try:
            hf, truncated = hf_throughput(args.model, lens[:subset], args.hf_batch, args.device, args.hf_max_seconds)
            row.update(hf_requests=subset, hf_batch=args.hf_batch, hf_output_tokens_per_s=hf, hf_truncated=truncated)
            kiln_same = row.get("subset_output_tokens_per_s", row.get("output_tokens_per_s"))
            if kiln_same is not None and not truncated:  # a cut-short baseline gives no ratio (no extrapolation)
                row["x_hf"] = kiln_same / hf
        except Exception as exc:
            traceback.print_exc()
            row["hf_error"] = f"{type(exc).__name__}: {exc}"
    scalars = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}  # timelines: in the JSON
    print(table(list(scalars), [list(scalars.values())]))
    return [row]


def roofline(rt: Runtime, lens: list[tuple[int, int]], steps: int, ceil: Ceilings, seconds: float) -> dict:
    """Every token passes every weight once (2 FLOPs each) + attention; bytes: the weights per step + KV reads."""
    wbytes = weight_bytes(rt)
    spec = rt.engine.loaded.spec
    in_tokens, out_tokens = sum(i for i, _ in lens), sum(o for _, o in lens)
    kv_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    attn_flops = sum(4 * spec.num_layers * spec.num_heads * spec.head_dim * ((i + o) ** 2) / 2 for i, o in lens)
    flops = 2 * (wbytes / 2) * (in_tokens + out_tokens) + attn_flops
    kv_read = sum(kv_token * sum(range(i, i + o)) for i, o in lens)
    roof = max(flops / ceil.matmul_flops_per_s, (wbytes * steps + kv_read) / ceil.copy_bytes_per_s)
    return dict(roofline_s=roof, fraction_of_roofline=roof / seconds)


def hf_throughput(model: str, lens: list[tuple[int, int]], batch: int, device: str = "cuda",
                  max_seconds: float | None = None) -> tuple[float, bool]:
    """transformers batched generate over the same workload, in length-sorted batches (its best case).

    -> (output tok/s counting each request's own length, whether max_seconds cut a batch short)."""
    hf = hf_model(model, device)
    rng = random.Random(1)
    order = sorted(lens, key=lambda x: x[0])
    total, truncated, start = 0, False, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            chunk = order[i:i + batch]
            width, new = max(c[0] for c in chunk), max(c[1] for c in chunk)
            vocab = min(1000, hf.config.vocab_size)
            ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(width)] for _ in chunk], device=device)
            left = None if max_seconds is None else max(1.0, max_seconds - (time.perf_counter() - start))
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0, max_time=left)
            if out.shape[1] - width < new:
                truncated = True
                print(f"HF stopped by --hf-max-seconds after {out.shape[1] - width} of {new} tokens", flush=True)
                break
            total += sum(c[1] for c in chunk)  # tokens beyond a request's own length are padding work
            print(f"HF batch {i // batch + 1}: {total} output tokens in {time.perf_counter() - start:.0f}s", flush=True)
    sync()
    del hf
    return total / (time.perf_counter() - start), truncated


def cmd_prefix_cache(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    """Prefix caching off vs on: requests sharing a long system prompt (the embedded model by default)."""
    extra = {} if args.device == "cpu" else dict(cudagraph_capture_sizes=tuple(args.capture_sizes))
    if args.device == "cuda":  # a fixed pool: the second runtime must not size itself around the first's leftovers
        extra["kv_cache_bytes"] = 8 << 30
    rows = []
    for caching in (False, True):
        rt = Runtime(args.model, level=args.level, device=args.device, enable_prefix_caching=caching,
                     max_num_batched_tokens=2048, max_num_seqs=args.requests, **extra)
        vocab = rt.engine.loaded.spec.vocab_size
        rng = random.Random(0)
        system = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        prompts = [system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]
                   for _ in range(args.requests)]
        # one request first populates the cache, as a previous conversation turn would
        rt.generate([prompts[0]], SamplingParams(max_tokens=1))
        rt.generate([prompts[0][-8:]], SamplingParams(max_tokens=2))  # warm-up outside the shared prefix
        start = time.perf_counter()
        outs = rt.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
        total = time.perf_counter() - start
        rows.append(dict(prefix_caching=caching, mean_ttft_ms=1e3 * sum(o.metrics.ttft for o in outs) / len(outs),
                         total_s=total, hit_rate=rt.stats()["prefix_cache_hit_rate"]))
        del rt
        gc.collect()
    off, on = rows
    print(f"{args.requests} requests sharing a {args.prefix_tokens}-token prefix, {args.max_tokens} output tokens, "
          f"-O{args.level}")
    print(table(["prefix caching", "mean TTFT ms", "total s", "hit rate"],
                [["on" if r["prefix_caching"] else "off", r["mean_ttft_ms"], r["total_s"], r["hit_rate"]]
                 for r in rows]))
    print(f"speed-up with caching: TTFT x{off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}, "
          f"total x{off['total_s'] / on['total_s']:.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("decode", "matrix", "throughput", "prefix-cache"):
        p = sub.add_parser(name)
        p.add_argument("--level", type=int, default=0 if name == "prefix-cache" else 2)
        p.add_argument("--backend", default="auto")
        p.add_argument("--json", default=None)
        p.add_argument("--capture-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
        p.add_argument("--passes", action="store_true", help="enable kiln's fusion passes (off: Inductor's own)")
        p.add_argument("--compile-sizes", type=int, nargs="*", default=None,
                       help="exact sizes to compile (default none: the dynamic range serves every size; "
                            "throughput --defaults: the level's own unless given)")
        if name in ("decode", "throughput"):
            p.add_argument("--hf", action="store_true", help="also run the transformers baseline")
            p.add_argument("--defaults", action="store_true",
                           help="kiln at its default settings (only model, device, backend and an explicit "
                                "--compile-sizes are set), not the tuned benchmark settings")
        if name == "decode":
            p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
            p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
            p.add_argument("--async-scheduling", choices=sorted(ASYNC_MODES), default="both",
                           help="overlap host work with the GPU: off, on, or both measured on one runtime")
        if name == "matrix":
            p.add_argument("--model", default="smollm2-135m")
            p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
            p.add_argument("--backends", nargs="+", default=["torch", "triton", "flashinfer"])
            p.add_argument("--modes", nargs="+", default=["EAGER", "NONE", "PIECEWISE", "FULL_AND_PIECEWISE"])
        if name in ("throughput", "matrix"):
            p.add_argument("--async-scheduling", action="store_true", help="overlap host work with the GPU")
        if name == "prefix-cache":
            p.add_argument("--model", default=None, help="HF directory or preset (default: the embedded model)")
            p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
            p.add_argument("--requests", type=int, default=32)
            p.add_argument("--prefix-tokens", type=int, default=512)
            p.add_argument("--max-tokens", type=int, default=16)
        if name in ("decode", "throughput"):
            p.add_argument("--quantization", default=None, choices=["fp8"], help="with --defaults: an FP8 model")
        if name == "throughput":
            p.add_argument("--model", default="llama3-8b")
            p.add_argument("--requests", type=int, default=256)
            p.add_argument("--min-len", type=int, default=100, help="input and output lengths: uniform in [min, max]")
            p.add_argument("--max-len", type=int, default=1024)
            p.add_argument("--device", default="cuda")
            p.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help="with --defaults: override this one default (an A/B of the token budget)")
            p.add_argument("--hf-batch", type=int, default=64)
            p.add_argument("--hf-requests", type=int, default=None,
                           help="run the baseline (and kiln again) on the first N requests only (default: all)")
            p.add_argument("--hf-max-seconds", type=float, default=None,
                           help="stop the baseline after this long; a cut-short baseline gives no ratio")
            p.add_argument("--hf-only", action="store_true", help="run only the transformers baseline")
            p.add_argument("--compile-ranges", type=int, nargs="*", default=None,
                           help="with --defaults: range end points (e.g. 256: decode sizes get their own artifact)")
            p.add_argument("--repeats", type=int, default=1,
                           help="time the whole workload this many times on one runtime; report the median run")
            p.add_argument("--inductor-option", action="append", default=None, metavar="NAME=VALUE",
                           type=parse_inductor_option,
                           help="with --defaults: an Inductor config entry (JSON value), e.g. combo_kernels=true")
    args = parser.parse_args()
    COMPILE_OPTIONS.update(cudagraph_capture_sizes=tuple(args.capture_sizes),
                           compile_sizes=tuple(args.compile_sizes or ()), enable_passes=args.passes)
    if args.cmd in ("throughput", "matrix"):  # decode measures both modes on one runtime (off|on|both)
        COMPILE_OPTIONS["async_scheduling"] = args.async_scheduling
    # no GPU (a CPU dry run): no ceilings, so no floors or roofline
    ceil = measure_ceilings() if torch.cuda.is_available() else no_ceilings()
    print(f"{stamp()}\ncopy bandwidth {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    commands = {"decode": cmd_decode, "matrix": cmd_matrix, "throughput": cmd_throughput,
                "prefix-cache": cmd_prefix_cache}
    rows = commands[args.cmd](args, ceil)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "ceilings": asdict(ceil), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
