"""FP8 against bf16 on one GPU at real shapes (random weights, a preset): FP8 linear weights
(`quantization="fp8"`) in decode steps and offline throughput, and an e4m3 KV cache (`kv_cache_dtype="fp8"`).

Parts, each recorded even if another fails:
- decode: mean engine step while `batch` requests decode (128-token prompts), bf16 then FP8;
- throughput: N requests with input and output lengths uniform in [100, 1024] (the offline workload of
  common.py), greedy, EOS ignored; output tokens/s, bf16 then FP8;
- accuracy: teacher-forced next-token distributions of FP8 models against bf16 and fp32 on ~900 tokens of real
  text, per scale granularity (benchmarks/fp8_accuracy.py; the embedded model on the CPU by default);
- kv: one runtime per KV dtype (auto, fp8): KV blocks in the same memory budget, the decode step at long
  contexts (BATCHxCONTEXT), and greedy agreement between the two on seeded prompts. The attention kernel alone
  on an e4m3 cache: `bench_attention.py --kv-cache-dtype fp8`.

--defaults builds each runtime at default settings (only model, dummy weights, attention backend and the
quantization set); otherwise -O2 with graphs at the decode batches and async scheduling.

    python -m benchmarks.bench_fp8 --defaults --parts decode throughput --json fp8.json   # H200: ~5-6 min cold
    python -m benchmarks.bench_fp8 --parts kv --json kv.json                              # H200: ~3-5 min
    python -m benchmarks.bench_fp8 --parts decode --fp8-paths triton cublas --json d.json
    python -m benchmarks.bench_fp8 --parts accuracy --device cpu --json acc.json              # CPU: ~11 min
    python -m benchmarks.bench_fp8 --preset tiny-llama --device cpu --backend torch --requests 4 --batches 1 \
        --parts decode throughput kv --kv-configs 2x64 --json /tmp/fp8.json                # CPU dry run

The decode and throughput parts run bf16, then FP8 once per --fp8-paths entry: "triton" is the default
dispatch (kiln::fp8_gemm's Triton kernel up to TRITON_MAX_M tokens), "cublas" forces _scaled_mm everywhere.
On a GPU each decode row has its floor (benchmarks/common.py: weights and KV once at the copy bandwidth, or the
FLOPs at the matmul rate, both measured in the same run, whichever is longer).
The projection GEMMs alone, FP8 and bf16: bench_gemm.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
import traceback
from typing import Any

import torch

from benchmarks.common import (
    PROMPT_LEN,
    Ceilings,
    decode_floor_seconds,
    decode_step_seconds,
    measure_ceilings,
    no_ceilings,
    offline_requests,
    stamp,
    table,
    throughput_workload,
    timed_generate,
    weight_bytes,
)
from benchmarks.fp8_accuracy import GRANULARITIES
from benchmarks.fp8_accuracy import measure as measure_accuracy
from kiln import Runtime, SamplingParams
from kiln.models import dense_gemm
from kiln.models.quant import fp8_gemm

dense_gemm_max_m = dense_gemm.TRITON_MAX_M  # the default, restored after a cublas run


def build(args: argparse.Namespace, quantization: str | None) -> tuple[Runtime, float]:
    start = time.perf_counter()
    if args.defaults:  # what a user gets: only the model, dummy weights, the backend and the quantization
        rt = Runtime(args.preset, device=args.device, load_format="dummy", attention_backend=args.backend,
                     quantization=quantization)
        return rt, time.perf_counter() - start
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= args.max_num_seqs)
    rt = Runtime(args.preset, device=args.device, dtype="bf16" if args.device == "cuda" else "fp32",
                 load_format="dummy", level=args.level, attention_backend=args.backend, quantization=quantization,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 gpu_memory_utilization=0.85, async_scheduling=True,
                 cudagraph_capture_sizes=sizes if args.device == "cuda" else None, compile_sizes=())
    return rt, time.perf_counter() - start


def throughput(rt: Runtime, requests: int) -> dict:
    rng, lens = throughput_workload(requests)
    half = rt.engine.max_model_len // 2  # only binds for tiny presets (the CPU dry run)
    lens = [(min(i, half), min(o, half - 1)) for i, o in lens]
    prompts, params = offline_requests(rt, lens, rng)
    timeline: dict = {}
    seconds, out_tokens = timed_generate(rt, prompts, params, timeline)
    return dict(seconds=seconds, output_tokens=out_tokens, output_tokens_per_s=out_tokens / seconds,
                timeline=timeline)


def save(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def accuracy_table(acc: dict) -> str:
    refs = acc["references"]
    return table(["model", *(f"{h} {r}" for r in refs for h in ("top-1 vs", "KL vs")), "perplexity"],
                 [[row["model"], *(row[r][k] if r in row else "-" for r in refs for k in ("top1", "mean_kl")),
                   row["perplexity"]] for row in acc["rows"]])


def weight_gb(rt: Runtime) -> float:
    return weight_bytes(rt) / 1e9


def runtime_rows(args: argparse.Namespace, quantization: str | None, errors: dict[str, str],
                 fp8_path: str = "triton", ceil: Ceilings | None = None) -> tuple[list, list]:
    label = f"{quantization or 'bf16'}-{fp8_path}"
    ceil = ceil or no_ceilings()
    if quantization:
        fp8_gemm.TRITON_MAX_M = 0 if fp8_path == "cublas" else args.triton_max_m
    else:  # bf16: "cublas" keeps F.linear (no kiln::dense_gemm in the trace; the env var is in the cache key)
        dense_gemm.TRITON_MAX_M = 0 if fp8_path == "cublas" else dense_gemm_max_m
        os.environ["KILN_BF16_TRITON_MAX_M"] = str(dense_gemm.TRITON_MAX_M)
    decode, tput = [], []
    try:
        rt, build_s = build(args, quantization)
    except Exception:
        errors[f"build {label}"] = traceback.format_exc(limit=8)
        print(errors[f"build {label}"], flush=True)
        return decode, tput
    print(f"{label}: built in {build_s:.0f}s, {weight_gb(rt):.2f} GB of weights", flush=True)
    try:
        for batch in args.batches:
            step = decode_step_seconds(rt.engine, batch, PROMPT_LEN, args.steps)
            floor = max(decode_floor_seconds(rt, batch, ceil)) if args.device == "cuda" else float("nan")
            decode.append(dict(weights=label, batch=batch, step_ms=step * 1e3, tokens_per_s=batch / step,
                               floor_ms=floor * 1e3, x_floor=step / floor, build_s=build_s, weight_gb=weight_gb(rt)))
            print(decode[-1], flush=True)
    except Exception:
        errors[f"decode {label}"] = traceback.format_exc(limit=8)
        print(errors[f"decode {label}"], flush=True)
    if args.requests:
        try:
            tput.append(dict(weights=label, requests=args.requests, **throughput(rt, args.requests)))
            print(tput[-1], flush=True)
        except Exception:
            errors[f"throughput {label}"] = traceback.format_exc(limit=8)
            print(errors[f"throughput {label}"], flush=True)
    rt.engine.shutdown()
    del rt
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return decode, tput


# -- kv: kv_cache_dtype auto vs fp8 ------------------------------------------------------------------------
KV_DTYPES = ("auto", "fp8")


def parse_config(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    return int(batch), int(context)


def build_kv(args: argparse.Namespace, kv_cache_dtype: str, configs: list[tuple[int, int]]) -> Runtime:
    on_gpu = args.device == "cuda"
    longest = max(c for _, c in configs) + args.steps + 64
    return Runtime(args.preset, device=args.device, dtype="bf16" if on_gpu else "fp32", load_format="dummy",
                   attention_backend=args.backend if on_gpu else "torch", kv_cache_dtype=kv_cache_dtype,
                   max_num_seqs=max(b for b, _ in configs), max_num_batched_tokens=8192 if on_gpu else 512,
                   max_model_len=max(longest, args.prompt_len + args.new_tokens + 16),
                   gpu_memory_utilization=0.85, level=args.level,
                   kv_cache_bytes=None if on_gpu else 64 << 20,
                   # graphs only at the sizes this run decodes (the agreement batch, the configs' batches) and
                   # no exact-size compiles: the range artifact serves every size, so start-up stays short
                   cudagraph_capture_sizes=tuple(sorted({1, 2, 4, 8, args.prompts, *(b for b, _ in configs)})),
                   compile_sizes=())


def agreement_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(vocab) for _ in range(length - 7 * i)] for i in range(count)]


def measure(args: argparse.Namespace, kv_cache_dtype: str, configs: list[tuple[int, int]]) -> dict:
    row: dict = dict(kv_cache_dtype=kv_cache_dtype, steps={}, errors=[])
    start = time.perf_counter()
    try:
        rt = build_kv(args, kv_cache_dtype, configs)
    except Exception as exc:
        row["errors"].append(f"build: {exc!r}")
        traceback.print_exc()
        return row
    engine = rt.engine
    row.update(build_s=time.perf_counter() - start, backend=engine.backend.name,
               cache_dtype=str(engine.worker.kv_cache.dtype), kv_blocks=engine.worker.num_blocks,
               kv_capacity_tokens=engine.kv_capacity_tokens,
               kv_bytes=engine.worker.kv_cache.numel() * engine.worker.kv_cache.element_size())
    print(f"{kv_cache_dtype}: built in {row['build_s']:.0f}s, {row['cache_dtype']}, {row['kv_blocks']} blocks "
          f"= {row['kv_capacity_tokens']} tokens", flush=True)
    try:
        prompts = agreement_prompts(engine.loaded.spec.vocab_size, args.prompts, args.prompt_len)
        outs = rt.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
        row["greedy"] = [o.outputs[0].token_ids for o in outs]
    except Exception as exc:
        row["errors"].append(f"greedy: {exc!r}")
        traceback.print_exc()
    for batch, context in configs:
        key = f"{batch}x{context}"
        if batch * (context + args.steps + 16) > row["kv_capacity_tokens"]:
            row["steps"][key] = dict(fits=False)
            print(f"  {key}: does not fit {row['kv_capacity_tokens']} tokens", flush=True)
            continue
        try:
            t0 = time.perf_counter()
            step = decode_step_seconds(engine, batch, context, args.steps)
            row["steps"][key] = dict(fits=True, step_ms=step * 1e3, wall_s=time.perf_counter() - t0)
            print(f"  {key}: {step * 1e3:.2f} ms/step ({time.perf_counter() - t0:.0f}s with prefill)", flush=True)
        except Exception as exc:
            row["steps"][key] = dict(fits=True, error=repr(exc))
            traceback.print_exc()
    del rt, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Per prompt: tokens before the first difference, and the share of equal tokens overall."""
    firsts = [first_divergence(a, b) for a, b in zip(base, other)]
    equal = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b))
    total = sum(min(len(a), len(b)) for a, b in zip(base, other))
    return dict(first_divergence=firsts, identical_prompts=sum(f == len(a) for f, a in zip(firsts, base)),
                prompts=len(base), equal_token_share=equal / max(total, 1))


def kv_part(args: argparse.Namespace) -> dict:
    configs = [parse_config(c) for c in args.kv_configs]
    rows = {d: measure(args, d, configs) for d in KV_DTYPES}
    result: dict = dict(model=args.preset, device=args.device, configs=args.kv_configs, runs=rows)
    base, fp8 = rows["auto"], rows["fp8"]
    if "greedy" in base and "greedy" in fp8:
        result["agreement"] = agreement(base["greedy"], fp8["greedy"])
    if base.get("kv_blocks") and fp8.get("kv_blocks"):
        result["fp8_blocks_x"] = (fp8["kv_blocks"] - 1) / max(base["kv_blocks"] - 1, 1)
    table_rows = []
    for key in args.kv_configs:
        a, f = base["steps"].get(key, {}), fp8["steps"].get(key, {})
        ms_a, ms_f = a.get("step_ms", float("nan")), f.get("step_ms", float("nan"))
        table_rows.append([key, ms_a if a.get("fits", True) else "no fit", ms_f if f.get("fits", True) else "no fit",
                           ms_f / ms_a if ms_a == ms_a and ms_f == ms_f else "-"])
    print(table(["batch x context", "auto ms/step", "fp8 ms/step", "fp8 / auto"], table_rows))
    print(f"KV blocks: auto {base.get('kv_blocks')}, fp8 {fp8.get('kv_blocks')} "
          f"(x{result.get('fp8_blocks_x', float('nan')):.2f}); greedy agreement: {result.get('agreement')}")
    return result



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--parts", nargs="+", default=["decode", "throughput"],
                        choices=["decode", "throughput", "kv", "accuracy"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256, help="offline throughput requests")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--defaults", action="store_true",
                        help="decode/throughput runtimes at default settings (ignores the sizing flags)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--fp8-paths", nargs="+", default=["triton"], choices=["triton", "cublas"])
    parser.add_argument("--bf16-paths", nargs="+", default=["triton"], choices=["triton", "cublas"],
                        help="bf16 projections: kiln::dense_gemm's Triton kernel at small M, or cuBLAS only")
    parser.add_argument("--no-bf16", action="store_true", help="decode/throughput: FP8 runs only (no bf16 build)")
    parser.add_argument("--triton-max-m", type=int, default=fp8_gemm.TRITON_MAX_M)
    parser.add_argument("--kv-configs", nargs="+", default=["64x2048", "64x4096", "256x2048", "256x4096"],
                        help="kv: BATCHxCONTEXT decode configs (context = prompt tokens before the timed steps)")
    parser.add_argument("--prompts", type=int, default=8, help="kv: greedy-agreement prompts")
    parser.add_argument("--prompt-len", type=int, default=256, help="kv: greedy-agreement prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="kv: greedy-agreement tokens")
    parser.add_argument("--accuracy-model", default=None, help="accuracy: the model (default: the embedded one)")
    parser.add_argument("--accuracy-dtype", default="bf16", help="accuracy: the FP8 models' activation dtype")
    parser.add_argument("--granularities", nargs="+", default=list(GRANULARITIES), choices=GRANULARITIES,
                        help="accuracy: weight/activation scale granularities")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "throughput" not in args.parts:
        args.requests = 0
    print(stamp(), flush=True)
    errors: dict[str, str] = {}
    result: dict[str, Any] = {"stamp": stamp(), "preset": args.preset, "args": vars(args), "errors": errors}
    decode, tput = [], []
    if "decode" in args.parts or args.requests:
        if "decode" not in args.parts:
            args.batches = []
        runs = ([] if args.no_bf16 else [(None, p) for p in args.bf16_paths]) + [("fp8", p) for p in args.fp8_paths]
        ceil = measure_ceilings() if args.device == "cuda" else no_ceilings()
        result["copy_gb_per_s"] = ceil.copy_bytes_per_s / 1e9
        for quantization, path in runs:
            d, t = runtime_rows(args, quantization, errors, path, ceil)
            decode += d
            tput += t
            result.update(decode=decode, throughput=tput)
            save(args.json, result)  # after every runtime: a run cut short keeps what it measured
    result.update(decode=decode, throughput=tput)
    if "accuracy" in args.parts:
        try:
            result["accuracy"] = measure_accuracy(args.accuracy_model, dtype=args.accuracy_dtype,
                                                  device=args.device, granularities=args.granularities)
            print(accuracy_table(result["accuracy"]))
        except Exception:
            errors["accuracy"] = traceback.format_exc(limit=8)
            print(errors["accuracy"], flush=True)
    if "kv" in args.parts:
        try:
            result["kv"] = kv_part(args)
        except Exception:
            errors["kv"] = traceback.format_exc(limit=8)
            print(errors["kv"], flush=True)
    save(args.json, result)
    if decode:
        bases = [w for w in ("bf16-triton", "bf16-cublas", "fp8-triton", "fp8-cublas")
                 if any(r["weights"] == w for r in decode)]
        base = {w: {r["batch"]: r["tokens_per_s"] for r in decode if r["weights"] == w} for w in bases}
        print(table(["weights", "batch", "step ms", "tok/s", "floor ms", "x floor", *(f"x {w} tok/s" for w in bases)],
                    [[r["weights"], r["batch"], r["step_ms"], r["tokens_per_s"], r["floor_ms"], r["x_floor"],
                      *(r["tokens_per_s"] / b[r["batch"]] if r["batch"] in b else float("nan") for b in base.values())]
                     for r in decode]))
    if tput:
        base = next((r["output_tokens_per_s"] for r in tput if r["weights"].startswith("bf16")), float("nan"))
        print(table(["weights", "requests", "seconds", "output tok/s", "x bf16"],
                    [[r["weights"], r["requests"], r["seconds"], r["output_tokens_per_s"],
                      r["output_tokens_per_s"] / base] for r in tput]))
    if errors:
        print("errors in: " + ", ".join(errors))


if __name__ == "__main__":
    main()
