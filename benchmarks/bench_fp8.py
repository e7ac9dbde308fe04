"""FP8 linear weights vs bf16 on one GPU (issue 17): GEMMs inside CUDA graphs, decode steps, offline throughput.

Random weights at real shapes (a preset), the runtime's default settings (-O2: compiled pieces, full and
piecewise CUDA graphs), async scheduling on, Triton attention. Four parts, each recorded even if
another fails:

0. kernels (benchmarks/fp8_kernel_sweep.py): per projection and M in 1..64, bf16 torch.mm, _scaled_mm and
   kiln's Triton FP8 GEMM at the heuristic's config and at every swept tile config, in CUDA graphs that
   rotate over more weight than L2 holds; floors at the copy bandwidth measured in the same run. Prints the
   per-(projection, M) summary, the per-step totals and a suggested `TUNED` table (all rows in the JSON).

1. gemm: each projection of the preset (qkv, o, gate_up, down) at M = 1 / 8 / 64 inside a CUDA graph
   (triton.testing.do_bench_cudagraph): bf16 F.linear, `torch._scaled_mm` alone (row-wise scales, the
   activation already in e4m3), and kiln's whole FP8 linear (per-token quantization + kiln::fp8_gemm, eager
   ops, so two kernels where the compiled model fuses the quantization into the norm/SiLU kernel before
   it). Floors: weight bytes / 4.3 TB/s (H200 HBM3e, nominal), for e4m3 and bf16.
2. decode: mean engine step while `batch` requests decode (128-token prompts), bf16 then fp8, the same
   compiled-runtime settings.
3. throughput: N requests with input and output lengths uniform in [100, 1024] (bench_gpu's seeded
   workload), greedy, EOS ignored; output tokens/s, bf16 then fp8.

    python -m benchmarks.bench_fp8 --json fp8.json                       # H200: llama3-8b, ~5-6 min cold
    python -m benchmarks.bench_fp8 --parts kernels --json k.json         # H200: the kernel sweep, ~1.5-2 min
    python -m benchmarks.bench_fp8 --parts decode --fp8-paths triton cublas --requests 0 --json d.json
    python -m benchmarks.bench_fp8 --preset tiny-llama --device cpu --backend torch --requests 4 --json /tmp/fp8.json
    python -m benchmarks.bench_fp8 --preset tiny-llama --device cpu --parts kernels --kernel-m 1 16 --json /tmp/k.json

The decode and throughput parts run bf16, then FP8 once per --fp8-paths entry: "triton" is the default
dispatch (kiln::fp8_gemm's Triton kernel up to TRITON_MAX_M tokens), "cublas" forces _scaled_mm everywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import fp8_kernel_sweep
from benchmarks.bench_gpu import offline_requests, throughput_workload, timed_generate
from benchmarks.common import decode_step_seconds, stamp, table
from kiln import Runtime
from kiln.models import dense_gemm
from kiln.models.loader.presets import PRESETS
from kiln.models.quant import fp8_gemm
from kiln.models.quant.fp8 import fp8_linear, quantize_per_token, quantize_weight

HBM_BYTES_PER_S = 4.3e12
dense_gemm_max_m = dense_gemm.TRITON_MAX_M  # the default, restored after a cublas run
PROMPT_LEN = 128


def projection_shapes(preset: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of the preset's four projections; with tp > 1 also one rank's shards ("qkv/tp2": column
    parallel projections split N, row parallel ones K)."""
    cfg = PRESETS[preset]
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim", h // heads)
    kv = cfg["num_key_value_heads"]
    full = {"qkv": (h, (heads + 2 * kv) * d), "o": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    if tp > 1:
        full |= {f"{name}/tp{tp}": (k // tp, n) if name in ("o", "down") else (k, n // tp)
                 for name, (k, n) in list(full.items())}
    return full


def time_us(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=50) * 1e3
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e6


def gemm_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (k, n) in projection_shapes(args.preset).items():
        for m in args.gemm_m:
            rows.append(dict(proj=name, K=k, N=n, M=m, **time_projection(k, n, m, args.device)))
            print(rows[-1], flush=True)
    return rows


def time_projection(k: int, n: int, m: int, device: str) -> dict[str, float]:
    """One projection at M tokens: bf16, _scaled_mm alone, kiln's FP8 linear; microseconds."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the CPU dry run: fp32 stands for bf16
    w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    wq, ws = quantize_weight(w)
    x = torch.randn(m, k, device=device, dtype=dtype)
    xq, xs = quantize_per_token(x)
    bf16 = time_us(lambda: F.linear(x, w), device)
    scaled = time_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=dtype),
                     device)
    whole = time_us(lambda: fp8_linear(x, wq, ws), device)
    floor = n * k / HBM_BYTES_PER_S * 1e6
    return dict(bf16_us=bf16, scaled_mm_us=scaled, fp8_linear_us=whole, fp8_floor_us=floor, bf16_floor_us=2 * floor,
                x_fp8_floor=scaled / floor, speedup=bf16 / scaled)


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


def weight_gb(rt: Runtime) -> float:
    params = {id(p): p for p in rt.engine.model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) / 1e9


def kernel_part(args: argparse.Namespace, errors: dict[str, str]) -> dict[str, Any]:
    """The kernel sweep; on CPU its Triton kernel runs under the interpreter (the flag only for this part)."""
    previous = os.environ.get("TRITON_INTERPRET")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        shapes = projection_shapes(args.preset, args.kernel_tp)
        result = fp8_kernel_sweep.kernel_table(shapes, args.device, tuple(args.kernel_m), args.kernel_budget_s,
                                               errors)
        layers = PRESETS[args.preset]["num_hidden_layers"]
        result["step_totals"] = fp8_kernel_sweep.step_totals(result["summary"], layers)
        return result
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def print_kernels(kernels: dict[str, Any]) -> None:
    print(f"copy bandwidth {kernels['copy_gb_per_s']:.0f} GB/s; sweep {kernels['seconds']:.0f} s"
          + (f"; skipped (budget): {kernels['skipped']}" if kernels["skipped"] else ""))
    cfg = (lambda c: f"{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"
           if c else "-")
    print(table(["proj", "M", "bf16 us", "_scaled_mm us", "triton auto us", "triton best us", "best config",
                 "best GB/s", "fp8 floor us", "best x floor", "_scaled_mm / best", "auto / best"],
                [[r["proj"], r["M"], r["bf16_us"], r["scaled_mm_us"], r["auto_us"], r["best_us"],
                  cfg(r["best_config"]), r["best_gb_per_s"], r["fp8_floor_us"], r["best_us"] / r["fp8_floor_us"],
                  r["scaled_mm_us"] / r["best_us"], r["auto_us"] / r["best_us"]] for r in kernels["summary"]]))
    print(table(["proj", "M", "cuBLAS bf16 us", "triton bf16 auto us", "triton bf16 best us", "best config",
                 "cuBLAS / best"],
                [[r["proj"], r["M"], r["bf16_us"], r["bf16_triton_auto_us"], r["bf16_triton_best_us"],
                  cfg(r["bf16_triton_best_config"]), r["bf16_us"] / r["bf16_triton_best_us"]]
                 for r in kernels["summary"]]))
    print(table(["shard", "M", "projections", "bf16 ms/step", "triton bf16 auto", "triton bf16 best",
                 "_scaled_mm ms/step", "triton auto ms/step", "triton best ms/step", "fp8 floor ms/step"],
                [[r["shard"], r["M"], r["projections"], r["bf16_ms"], r["bf16_triton_auto_ms"],
                  r["bf16_triton_best_ms"], r["scaled_mm_ms"], r["auto_ms"], r["best_ms"], r["fp8_floor_ms"]]
                 for r in kernels["step_totals"]]))
    print(kernels["suggested_tuned"])


def runtime_rows(args: argparse.Namespace, quantization: str | None, errors: dict[str, str],
                 fp8_path: str = "triton") -> tuple[list, list]:
    label = f"{quantization or 'bf16'}-{fp8_path}"
    if quantization:
        # read per call by kiln::fp8_gemm; set before the build so its CUDA graphs capture this path
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
            decode.append(dict(weights=label, batch=batch, step_ms=step * 1e3, tokens_per_s=batch / step,
                               build_s=build_s, weight_gb=weight_gb(rt)))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--gemm-m", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256, help="offline throughput requests (0: skip)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--defaults", action="store_true",
                        help="decode/throughput runtimes at default settings (ignores the sizing flags)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--parts", nargs="+", default=["gemm", "decode", "throughput"],
                        choices=["kernels", "gemm", "decode", "throughput"])
    parser.add_argument("--kernel-m", type=int, nargs="+", default=list(fp8_kernel_sweep.KERNEL_M))
    parser.add_argument("--kernel-tp", type=int, default=1, help="kernel sweep: also one rank's shards at this TP")
    parser.add_argument("--kernel-budget-s", type=float, default=120.0,
                        help="kernel sweep: no new projection is started after this many seconds")
    parser.add_argument("--fp8-paths", nargs="+", default=["triton"], choices=["triton", "cublas"])
    parser.add_argument("--bf16-paths", nargs="+", default=["triton"], choices=["triton", "cublas"],
                        help="bf16 projections: kiln::dense_gemm's Triton kernel at small M, or cuBLAS only")
    parser.add_argument("--no-bf16", action="store_true", help="decode/throughput: FP8 runs only (no bf16 build)")
    parser.add_argument("--triton-max-m", type=int, default=fp8_gemm.TRITON_MAX_M)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "throughput" not in args.parts:
        args.requests = 0
    print(stamp(), flush=True)
    errors: dict[str, str] = {}
    result: dict[str, Any] = {"stamp": stamp(), "preset": args.preset, "args": vars(args), "errors": errors}
    if "kernels" in args.parts:
        try:
            result["kernels"] = kernel_part(args, errors)
        except Exception:
            errors["kernels"] = traceback.format_exc(limit=8)
            print(errors["kernels"], flush=True)
    if "gemm" in args.parts:
        try:
            result["gemm"] = gemm_rows(args)
        except Exception:
            errors["gemm"] = traceback.format_exc(limit=8)
            print(errors["gemm"], flush=True)
    decode, tput = [], []
    if "decode" in args.parts or args.requests:
        if "decode" not in args.parts:
            args.batches = []
        runs = ([] if args.no_bf16 else [(None, p) for p in args.bf16_paths]) + [("fp8", p) for p in args.fp8_paths]
        for quantization, path in runs:
            d, t = runtime_rows(args, quantization, errors, path)
            decode += d
            tput += t
    result.update(decode=decode, throughput=tput)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if result.get("kernels"):
        print_kernels(result["kernels"])
    if result.get("gemm"):
        print(table(["proj", "K", "N", "M", "bf16 us", "_scaled_mm us", "fp8 linear us", "fp8 floor us",
                     "x fp8 floor", "bf16/fp8"],
                    [[r["proj"], r["K"], r["N"], r["M"], r["bf16_us"], r["scaled_mm_us"], r["fp8_linear_us"],
                      r["fp8_floor_us"], r["x_fp8_floor"], r["speedup"]] for r in result["gemm"]]))
    if decode:
        base = {w: {r["batch"]: r["tokens_per_s"] for r in decode if r["weights"] == w}
                for w in ("bf16-triton", "bf16-cublas", "fp8-cublas")}
        print(table(["weights", "batch", "step ms", "tok/s", "x bf16 tok/s", "x bf16-cublas tok/s",
                     "x fp8-cublas tok/s"],
                    [[r["weights"], r["batch"], r["step_ms"], r["tokens_per_s"],
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
