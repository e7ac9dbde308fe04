"""The GPU benchmark (H200 reference): decode latency, offline throughput, each backend x graph mode.

Random bf16 weights at real shapes (presets), greedy, EOS ignored. Every number is printed next to a
floor or baseline measured in the same run: the copy bandwidth and matmul rate of this GPU, and
transformers' eager `generate` on the same shapes.

    python benchmarks/bench_gpu.py decode --models smollm2-135m llama3-8b --batches 1 8 64
    python benchmarks/bench_gpu.py throughput --model llama3-8b --requests 256
    python -m benchmarks.bench_gpu throughput --defaults --backend triton --hf --hf-requests 64   # issue 16
    python benchmarks/bench_gpu.py matrix --model smollm2-135m      # every backend x graph mode
    python benchmarks/bench_gpu.py tp --model llama3-70b --tp 2     # tensor parallel decode (one config a run)
    python -m benchmarks.bench_gpu kv-dtype --model llama3-8b --json kv.json   # fp8 vs auto KV (bench_kv_dtype.py)

Writes a JSON of all rows to --json when given.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import decode_step_seconds as common_decode_step_seconds
from benchmarks.common import stamp, table
from benchmarks.step_timeline import StepTimeline
from kiln import Runtime, SamplingParams
from kiln.entrypoints.cli.main import parse_inductor_option

PROMPT_LEN = 128


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


def measure_ceilings() -> Ceilings:
    n = 1 << 30  # 1 GiB each way: well past L2
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy = 2 * n * 10 / (start.elapsed_time(end) / 1000)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1000)
    del src, dst, a, b
    torch.cuda.empty_cache()
    return Ceilings(copy, flops)


def weight_bytes(rt: Runtime) -> int:
    seen, total = set(), 0
    for p in rt.engine.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


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


def decode_step_seconds(rt: Runtime, batch: int, steps: int = 32) -> float:
    """Mean time of one engine step while `batch` requests decode (prompts of PROMPT_LEN tokens)."""
    return common_decode_step_seconds(rt.engine, batch, PROMPT_LEN, steps)


def decode_floor_seconds(rt: Runtime, batch: int, ceil: Ceilings) -> tuple[float, float]:
    """(bytes floor, compute floor) of one decode step on one GPU: its weights once + each request's KV, vs
    2*params FLOPs. Under tensor parallelism every GPU reads only its shard, so the floor is per shard."""
    wbytes = weight_bytes(rt)  # this rank's shard
    spec = rt.engine.loaded.spec
    kv_heads = rt.engine.kv_cache.shape[-2]  # KV heads held by this rank
    kv_token = 2 * spec.num_layers * kv_heads * spec.head_dim * 2
    kv = batch * (PROMPT_LEN + 16) * kv_token
    flops = 2 * (wbytes / 2) * batch
    return (wbytes + kv) / ceil.copy_bytes_per_s, flops / ceil.matmul_flops_per_s


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
        rt, build = make_runtime(model, level=args.level, attention_backend=args.backend)
        print(f"{model}: built in {build:.1f}s, backend {rt.engine.backend.name}", flush=True)
        steps = {}
        for overlap in ASYNC_MODES[args.async_scheduling]:
            rt.engine.async_scheduling = overlap  # switchable between steps: an A/B on one compiled runtime
            steps.update({(batch, overlap): decode_step_seconds(rt, batch) for batch in args.batches})
        floors = {batch: decode_floor_seconds(rt, batch, ceil) for batch in args.batches}
        del rt
        torch.cuda.empty_cache()
        hf_net = hf_model(model) if args.hf else None
        for batch in args.batches:
            bytes_floor, compute_floor = floors[batch]
            hf = hf_decode_tokens_per_s(hf_net, batch) if hf_net is not None else float("nan")
            for overlap in ASYNC_MODES[args.async_scheduling]:
                step = steps[batch, overlap]
                rows.append(dict(model=model, batch=batch, backend=args.backend, async_scheduling=overlap,
                                 step_ms=step * 1e3, tokens_per_s=batch / step,
                                 floor_ms=max(bytes_floor, compute_floor) * 1e3,
                                 x_floor=step / max(bytes_floor, compute_floor), hf_tokens_per_s=hf,
                                 x_hf=(batch / step) / hf if hf == hf else float("nan")))
                print(rows[-1], flush=True)
        del hf_net
        torch.cuda.empty_cache()
    print(table(["model", "batch", "backend", "async", "step ms", "tok/s", "floor ms", "x floor", "HF tok/s", "x HF"],
                [[r["model"], r["batch"], r["backend"], r["async_scheduling"], r["step_ms"], r["tokens_per_s"],
                  r["floor_ms"], r["x_floor"], r["hf_tokens_per_s"], r["x_hf"]] for r in rows]))
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
                step = decode_step_seconds(rt, batch)
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


def cmd_tp(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    """Decode at each batch with the model split over --tp GPUs (one config per process: NCCL state stays clean)."""
    mode = {} if args.cudagraph_mode == "default" else dict(cudagraph_mode=args.cudagraph_mode)
    rt, build = make_runtime(args.model, level=args.level, attention_backend=args.backend,
                             tensor_parallel_size=args.tp, **mode)
    graphs = rt.engine.worker.compilation.cudagraph_mode
    print(f"{args.model} TP={args.tp}: built in {build:.1f}s, {weight_bytes(rt) / 1e9:.1f} GB of weights per GPU",
          flush=True)
    rows = []
    try:
        for batch in args.batches:
            step = decode_step_seconds(rt, batch)
            floor = max(decode_floor_seconds(rt, batch, ceil))
            rows.append(dict(model=args.model, tp=args.tp, batch=batch, step_ms=step * 1e3, tokens_per_s=batch / step,
                             floor_ms=floor * 1e3, x_floor=step / floor, build_s=build))
            print(rows[-1], flush=True)
    finally:
        start = time.perf_counter()
        rt.engine.shutdown()
        shutdown = time.perf_counter() - start
        print(f"shutdown took {shutdown:.1f}s", flush=True)
        for row in rows:
            row["shutdown_s"] = shutdown
    print(table(["model", "TP", "graphs", "batch", "step ms", "tok/s", "floor ms (per GPU)", "x floor"],
                [[r["model"], r["tp"], graphs, r["batch"], r["step_ms"], r["tokens_per_s"], r["floor_ms"],
                  r["x_floor"]] for r in rows]))
    return rows


def throughput_workload(requests: int, low: int = 100, high: int = 1024) -> tuple[random.Random, list[tuple[int, int]]]:
    """(rng for the prompt tokens, (input, output) lengths uniform in [low, high]), seeded."""
    rng = random.Random(0)
    return rng, [(rng.randint(low, high), rng.randint(low, high)) for _ in range(requests)]


def default_runtime(args: argparse.Namespace) -> tuple[Runtime, float]:
    """The runtime a user gets without flags: only the model, dummy weights, device and attention backend
    (and --compile-sizes / --max-num-batched-tokens when given) are set; the rest is Runtime's default."""
    kwargs = {} if args.compile_sizes is None else {"compile_sizes": tuple(args.compile_sizes)}
    if args.max_num_batched_tokens is not None:  # the one default an A/B may move (8192 vs 2048 on GPU)
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "compile_ranges", None):  # an A/B of the compile plan: extra range end points
        kwargs["compile_ranges"] = tuple(args.compile_ranges)
    if args.quantization:  # an FP8 model at its defaults (issue 17)
        kwargs["quantization"] = args.quantization
    if getattr(args, "inductor_option", None):  # an A/B of an Inductor setting (parsed as `kiln` parses it)
        kwargs["inductor_options"] = dict(args.inductor_option)
    start = time.perf_counter()
    rt = Runtime(args.model, device=args.device, load_format="dummy", attention_backend=args.backend, **kwargs)
    return rt, time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def offline_requests(rt: Runtime, lens: list[tuple[int, int]], rng: random.Random,
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The workload's prompts (random token ids) and greedy, EOS-ignoring sampling params."""
    vocab = rt.engine.loaded.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(i)] for i, _ in lens]
    return prompts, [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in lens]


def warm_up(rt: Runtime, lens: list[tuple[int, int]], rng: random.Random) -> None:
    """A few short requests on prompts of their own: first-step costs, and nothing the timed prompts would
    find in the prefix cache."""
    prompts, _ = offline_requests(rt, lens[:4], rng)
    rt.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))


def timed_generate(rt: Runtime, prompts: list[list[int]], params: list[SamplingParams],
                   timeline: dict | None = None) -> tuple[float, int]:
    """(seconds, output tokens) of one Runtime.generate over every request at once; `timeline`, when
    given, receives the run's per-step-kind breakdown (step_timeline.py)."""
    sync()
    start = time.perf_counter()
    with StepTimeline(rt.engine) as steps:
        outs = rt.generate(prompts, params)
        sync()
    if timeline is not None:
        timeline.update(steps.summary())
        print(table(["steps", "count", "seconds", "ms/step", "prefill tokens", "decode tokens"],
                    [[k, v["steps"], v["seconds"], v["ms_per_step"], v["prefill_tokens"], v["decode_tokens"]]
                     for k, v in timeline.items()]), flush=True)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


@contextlib.contextmanager
def full_row_block_tables(rt: Runtime) -> Iterator[None]:
    """The block-table upload before b732e18: every request's whole row (max_model_len / block_size columns)
    each step, where the shipped runner uploads only the columns in use."""
    runner = rt.engine.runner

    def upload_rows(num_reqs: int, width: int, non_blocking: bool) -> None:
        runner.block_tables[:num_reqs].copy_(runner.block_tables_cpu[:num_reqs], non_blocking=non_blocking)

    runner._upload_block_tables = upload_rows
    try:
        yield
    finally:
        del runner._upload_block_tables


@contextlib.contextmanager
def attention_before(rt: Runtime) -> Iterator[None]:
    """Mixed steps as before 2026-11-30's tenth session: the leading decodes in the varlen kernel with the
    prefill chunks, at the varlen kernel's old tile (one process, rank 0's backend: a TP=1 arm)."""
    from benchmarks.bench_attention import BEFORE_TILE, tile_cfg

    backend = rt.engine.worker.backend
    saved = backend.mixed_decode_min, backend._prefill_cfg
    backend.mixed_decode_min = 0
    backend._prefill_cfg = tile_cfg(BEFORE_TILE, backend._prefill_cfg["GROUP_PAD"])
    try:
        yield
    finally:
        backend.mixed_decode_min, backend._prefill_cfg = saved


# --ab: an arm interleaved with the defaults' runs
AB_ARMS = {"full_row_block_tables": full_row_block_tables, "attention_before": attention_before}


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
        rt, build = default_runtime(args) if args.defaults else make_runtime(
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
        runs, ab_runs = [], []
        for i in range(args.repeats):  # the workload again on the same runtime: the spread between runs
            if i:  # new prompt tokens, the same lengths: a repeated prompt would be a prefix-cache hit
                prompts, params = offline_requests(rt, lens, rng)
            steps_before = rt.stats()["steps"]
            timeline: dict = {}
            if args.ab and i % 2:  # the odd runs are the A/B's other arm, interleaved with the defaults
                with AB_ARMS[args.ab](rt):
                    seconds, out_tokens = timed_generate(rt, prompts, params, timeline)
                ab_runs.append(out_tokens / seconds)
                print(f"run {i + 1} ({args.ab}): {ab_runs[-1]:.0f} output tok/s", flush=True)
                continue
            seconds, out_tokens = timed_generate(rt, prompts, params, timeline)
            runs.append((out_tokens / seconds, seconds, rt.stats()["steps"] - steps_before, timeline))
            print(f"run {i + 1}: {runs[-1][0]:.0f} output tok/s", flush=True)
        if args.ab:
            row.update(ab=args.ab, ab_output_tokens_per_s=[round(r, 1) for r in ab_runs])
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
    print(table(list(row), [list(row.values())]))
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


def cmd_profile(args: argparse.Namespace, ceil: Ceilings) -> list[dict]:
    """Where a decode step's time goes: torch.profiler over steady-state decode steps."""
    from torch.profiler import ProfilerActivity, profile

    rt, _ = make_runtime(args.model, level=args.level, attention_backend=args.backend)
    engine = rt.engine
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(list(range(1, PROMPT_LEN + 1)), params)
    for _ in range(8):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(16):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("decode", "matrix", "throughput", "profile", "tp", "kv-dtype"):
        p = sub.add_parser(name)
        p.add_argument("--level", type=int, default=2)
        p.add_argument("--backend", default="auto")
        p.add_argument("--hf", action="store_true", help="also run the transformers baseline")
        p.add_argument("--json", default=None)
        p.add_argument("--capture-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
        p.add_argument("--passes", action="store_true", help="enable kiln's fusion passes (off: Inductor's own)")
        p.add_argument("--compile-sizes", type=int, nargs="*", default=None,
                       help="exact sizes to compile (default none: the dynamic range serves every size; "
                            "throughput --defaults: the level's own unless given)")
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
        if name == "tp":
            p.add_argument("--model", default="llama3-8b")
            p.add_argument("--tp", type=int, default=2)
            p.add_argument("--cudagraph-mode", default="default", help="default: the level's own (graphs on)")
            p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
        if name == "kv-dtype":
            from benchmarks.bench_kv_dtype import add_arguments

            add_arguments(p)
        if name == "profile":
            p.add_argument("--model", default="smollm2-135m")
            p.add_argument("--batch", type=int, default=1)
        if name in ("throughput", "profile", "matrix", "tp"):
            p.add_argument("--async-scheduling", action="store_true", help="overlap host work with the GPU")
        if name == "throughput":
            p.add_argument("--model", default="llama3-8b")
            p.add_argument("--requests", type=int, default=256)
            p.add_argument("--min-len", type=int, default=100, help="input and output lengths: uniform in [min, max]")
            p.add_argument("--max-len", type=int, default=1024)
            p.add_argument("--defaults", action="store_true",
                           help="kiln at its default settings (only model, device, backend and an explicit "
                                "--compile-sizes are set), not the tuned benchmark settings")
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
            p.add_argument("--ab", choices=sorted(AB_ARMS), default=None,
                           help="with --repeats: the odd runs use this arm (an in-process A/B)")
            p.add_argument("--repeats", type=int, default=1,
                           help="time the whole workload this many times on one runtime; report the median run")
            p.add_argument("--quantization", default=None, choices=["fp8"], help="with --defaults: an FP8 model")
            p.add_argument("--inductor-option", action="append", default=None, metavar="NAME=VALUE",
                           type=parse_inductor_option,
                           help="with --defaults: an Inductor config entry (JSON value), e.g. combo_kernels=true")
    args = parser.parse_args()
    if args.cmd == "kv-dtype":  # its own runtimes (CPU dry run included), no floors
        from benchmarks.bench_kv_dtype import cmd_kv_dtype

        if args.backend == "auto":
            args.backend = "triton"
        result = dict(stamp=stamp(), **cmd_kv_dtype(args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    COMPILE_OPTIONS.update(cudagraph_capture_sizes=tuple(args.capture_sizes),
                           compile_sizes=tuple(args.compile_sizes or ()), enable_passes=args.passes)
    if args.cmd != "decode":  # decode measures both modes on one runtime (--async-scheduling off|on|both)
        COMPILE_OPTIONS["async_scheduling"] = args.async_scheduling
    # no GPU (a CPU dry run of `throughput --device cpu`): no ceilings, so no floors or roofline
    ceil = measure_ceilings() if torch.cuda.is_available() else Ceilings(float("nan"), float("nan"))
    print(f"{stamp()}\ncopy bandwidth {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    commands = {"decode": cmd_decode, "matrix": cmd_matrix, "throughput": cmd_throughput, "profile": cmd_profile,
                "tp": cmd_tp}
    rows = commands[args.cmd](args, ceil)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "ceilings": asdict(ceil), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
