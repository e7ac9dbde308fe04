"""kv_cache_dtype auto vs fp8 (issue 17): decode step time at long contexts, KV blocks, greedy agreement.

One runtime per KV dtype, built in sequence in this process (the second reuses the first's compile artifacts:
the KV dtype is not part of the compile key, docs/cache.md). For each, on random weights:
  - the KV blocks (and tokens) the same memory budget holds,
  - greedy tokens on a few seeded random prompts, compared across the two dtypes afterwards,
  - the mean decode step time for each BATCHxCONTEXT config (prefill first, untimed); a config whose
    tokens do not fit the dtype's KV capacity is recorded as such, not run (it would only preempt).
First, on a GPU, the Triton decode attention alone at each config for a bf16 and an fp8 cache (seconds).
Every part catches its own failure into the JSON. Run through bench_gpu:

    python -m benchmarks.bench_gpu kv-dtype --model llama3-8b --json kv_dtype.json      # H200: ~3-5 min
    python -m benchmarks.bench_gpu kv-dtype --model tiny-llama --device cpu --configs 4x64 --json /tmp/k.json
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import traceback

import torch

from benchmarks.common import decode_step_seconds, table
from kiln import Runtime, SamplingParams

KV_DTYPES = ("auto", "fp8")


def parse_config(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    return int(batch), int(context)


def build(args: argparse.Namespace, kv_cache_dtype: str, configs: list[tuple[int, int]]) -> Runtime:
    on_gpu = args.device == "cuda"
    longest = max(c for _, c in configs) + args.steps + 64
    return Runtime(args.model, device=args.device, dtype="bf16" if on_gpu else "fp32", load_format="dummy",
                   attention_backend=args.backend if on_gpu else "torch", kv_cache_dtype=kv_cache_dtype,
                   max_num_seqs=max(b for b, _ in configs), max_num_batched_tokens=8192 if on_gpu else 512,
                   max_model_len=max(longest, args.prompt_len + args.new_tokens + 16),
                   gpu_memory_utilization=args.gpu_memory_utilization, level=args.level,
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
        rt = build(args, kv_cache_dtype, configs)
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


def attention_only(configs: list[tuple[int, int]]) -> list[dict]:
    """The Triton decode attention alone (KV write + attention, CUDA-graph replay, L2 flushed) at Llama-3-8B
    heads for a bf16 and an fp8 copy of the same cache: the kernel's share of the step difference."""
    from benchmarks.bench_attention import BS, DTYPE, HKV, HQ, D, make_step, time_step
    from kiln.attention import AttentionLayout, select_backend

    cuda = torch.device("cuda")
    rows = []
    for batch, context in configs:
        row: dict = dict(config=f"{batch}x{context}")
        try:
            tensors, common = make_step([1] * batch, [context - 1] * batch)
            q, k, v, out, cache = tensors
            outs = {}
            for name, kv_dtype in (("auto", None), ("fp8", torch.float8_e4m3fn)):
                layout = AttentionLayout(HQ, HKV, D, D ** -0.5, BS, DTYPE, kv_dtype)
                backend = select_backend("triton", layout, cuda)(layout, cuda)
                kv = cache if kv_dtype is None else cache.clamp(-448, 448).to(kv_dtype)
                row[f"{name}_us"] = time_step(backend, (q, k, v, out, kv), common, graph=True) * 1e3
                outs[name] = out.float().clone()
                del kv
            row["fp8_rel_err"] = float((outs["fp8"] - outs["auto"]).norm() / outs["auto"].norm())
            del tensors, cache, q, k, v, out
        except Exception as exc:
            row["error"] = repr(exc)
            traceback.print_exc()
        rows.append(row)
        print(f"  attention {row}", flush=True)
        torch.cuda.empty_cache()
    return rows


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Per prompt: tokens before the first difference, and the share of equal tokens overall."""
    firsts = [first_divergence(a, b) for a, b in zip(base, other)]
    equal = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b))
    total = sum(min(len(a), len(b)) for a, b in zip(base, other))
    return dict(first_divergence=firsts, identical_prompts=sum(f == len(a) for f, a in zip(firsts, base)),
                prompts=len(base), equal_token_share=equal / max(total, 1))


def cmd_kv_dtype(args: argparse.Namespace) -> dict:
    configs = [parse_config(c) for c in args.configs]
    attention = attention_only(configs) if args.device == "cuda" else []
    rows = {d: measure(args, d, configs) for d in KV_DTYPES}
    result: dict = dict(model=args.model, device=args.device, configs=args.configs, runs=rows, attention=attention)
    base, fp8 = rows["auto"], rows["fp8"]
    if "greedy" in base and "greedy" in fp8:
        result["agreement"] = agreement(base["greedy"], fp8["greedy"])
    if base.get("kv_blocks") and fp8.get("kv_blocks"):
        result["fp8_blocks_x"] = (fp8["kv_blocks"] - 1) / max(base["kv_blocks"] - 1, 1)
    table_rows = []
    for key in args.configs:
        a, f = base["steps"].get(key, {}), fp8["steps"].get(key, {})
        ms_a, ms_f = a.get("step_ms", float("nan")), f.get("step_ms", float("nan"))
        table_rows.append([key, ms_a if a.get("fits", True) else "no fit", ms_f if f.get("fits", True) else "no fit",
                           ms_f / ms_a if ms_a == ms_a and ms_f == ms_f else "-"])
    print(table(["batch x context", "auto ms/step", "fp8 ms/step", "fp8 / auto"], table_rows))
    if attention:
        print(table(["batch x context", "attention auto us", "attention fp8 us", "fp8 / auto", "fp8 rel err"],
                    [[r["config"], r.get("auto_us", "-"), r.get("fp8_us", "-"),
                      r["fp8_us"] / r["auto_us"] if "fp8_us" in r else "-", r.get("fp8_rel_err", "-")]
                     for r in attention]))
    print(f"KV blocks: auto {base.get('kv_blocks')}, fp8 {fp8.get('kv_blocks')} "
          f"(x{result.get('fp8_blocks_x', float('nan')):.2f}); greedy agreement: {result.get('agreement')}")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--configs", nargs="+", default=["64x2048", "64x4096", "256x2048", "256x4096"],
                   help="BATCHxCONTEXT decode configs (context = prompt tokens before the timed steps)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per config")
    p.add_argument("--prompts", type=int, default=8, help="greedy-agreement prompts")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)  # as bench_gpu: room for graphs
