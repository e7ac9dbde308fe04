"""Mixture-of-experts serving on one GPU: Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8), random bf16
weights drawn on the GPU, kiln's default settings. Every figure is printed beside a floor measured in the same
run (this GPU's copy bandwidth):

- decode ms/step at batch 1 / 8 / 64 vs the active-weight floor (the bytes a step must read: attention, router,
  norms and LM head, plus the experts the batch's tokens touch under uniform routing, plus the KV cache) and the
  full-weight floor (every expert);
- the offline run (256 requests, input and output lengths uniform in 100..1024, greedy, EOS ignored) beside the
  time its decode steps would take at the floors;
- one MoE layer: a plain torch loop over experts (kiln's reference path) vs the fused op, per token count; the
  fused op inside a CUDA graph beside the bytes of the experts it must read, in bf16 and with FP8 experts (and, up
  to 8 tokens, with the grouped kernels' blocks laid out through the align kernel and one pair a block, one
  process).

    python -m benchmarks.bench_moe --json moe.json [--model qwen3-30b-a3b] [--parts layer decode offline]

Each part records its failure in the JSON instead of ending the run.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from benchmarks.bench_gpu import measure_ceilings, offline_requests, throughput_workload, warm_up
from benchmarks.common import decode_step_seconds, graphed_microseconds, stamp, table
from kiln import Runtime
from kiln.models.base import ModelSpec
from kiln.models.fused_moe import kernels as moe_kernels
from kiln.models.fused_moe.kernels import fused_moe_triton
from kiln.models.fused_moe.reference import fused_moe_reference
from kiln.models.loader.presets import preset_view
from kiln.models.quant.fp8 import quantize_weight

PROMPT_LEN = 128


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer reads for `batch` tokens, each choosing top_k distinct experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(spec: ModelSpec, batch: int, all_experts: bool, context: int = PROMPT_LEN + 16) -> float:
    """Bytes one decode step must read (bf16): every non-expert weight but the embedding table, the touched
    (or all) experts, and each request's KV cache."""
    moe = spec.moe
    h, d = spec.hidden_size, spec.head_dim
    attn = h * d * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 2 * d + 2 * h
    sparse = spec.num_layers - len(moe.dense_layers)
    router = moe.num_experts * h
    expert = 3 * h * moe.intermediate_size
    touched = moe.num_experts if all_experts else expected_experts_touched(moe.num_experts, moe.top_k, batch)
    dense_mlp = 3 * h * spec.intermediate_size
    params = (spec.num_layers * attn + sparse * (router + touched * expert) + len(moe.dense_layers) * dense_mlp
              + spec.vocab_size * h + h)
    kv = batch * context * 2 * spec.num_layers * spec.num_kv_heads * d
    return 2 * (params + kv)


def part_layer(spec: ModelSpec, copy_bps: float, rows: list[dict]) -> None:
    """One layer's experts: the torch loop (reference.py) vs the fused op, called eagerly on random routing
    (wall clock, synchronised), and the fused op inside a CUDA graph beside the bytes of the experts touched."""
    moe = spec.moe
    h, inter, e, k = spec.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    copies = [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(3)]  # rotated: past L2
    fp8 = [(*quantize_weight(a), *quantize_weight(b)) for a, b in copies]  # (w13, s13, w2, s2), e4m3
    for tokens in (1, 8, 64, 256, 1024):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, e, device="cuda")
        weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
        ids = ids.to(torch.int32)
        times = {}
        for name, fn in (("torch loop", fused_moe_reference), ("fused", fused_moe_triton)):
            fn(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                fn(x, w13, w2, weights, ids)
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - start) / 10 * 1e6

        def graphed(x=x, weights=weights, ids=ids) -> float:
            return graphed_microseconds(
                lambda i: fused_moe_triton(x, *copies[i % len(copies)], weights, ids), calls=8)

        times["graphed"] = graphed()
        default = moe_kernels.PAIR_BLOCK_TOKENS
        for name, bound in (("graphed_align", 0), ("graphed_pair_blocks", tokens)):  # both layouts, this process
            times[name] = float("nan")
            if tokens <= 8:
                moe_kernels.PAIR_BLOCK_TOKENS = bound
                try:
                    times[name] = graphed()
                finally:
                    moe_kernels.PAIR_BLOCK_TOKENS = default
        times["graphed_stream"] = times["fp8_graphed_stream"] = float("nan")
        if tokens == 1:  # the pair kernels at the streaming rule (KILN_MOE_STREAM), 16-bit and e4m3 experts
            fp8_args = [(w13q, w2q, s13, s2) for w13q, s13, w2q, s2 in fp8]
            for name, element_bytes, args in (("graphed_stream", 2, copies), ("fp8_graphed_stream", 1, fp8_args)):
                stream = moe_kernels.one_token_config(k, inter, h, element_bytes, x.device)
                times[name] = graphed_microseconds(
                    lambda i, x=x, weights=weights, ids=ids, stream=stream, args=args: fused_moe_triton(
                        x, *args[i % 4][:2], weights, ids, *args[i % 4][2:], config=stream), calls=8)
        times["fp8_graphed"] = graphed_microseconds(
            lambda i, x=x, weights=weights, ids=ids: fused_moe_triton(
                x, fp8[i % 4][0], fp8[i % 4][2], weights, ids, fp8[i % 4][1], fp8[i % 4][3]), calls=8)
        ref = fused_moe_reference(x, w13, w2, weights, ids).float()
        err = (fused_moe_triton(x, w13, w2, weights, ids).float() - ref).abs().max().item() / ref.abs().max().item()
        touched = expected_experts_touched(e, k, tokens)
        floor_us = touched * 3 * h * inter * 2 / copy_bps * 1e6
        rows.append(dict(part="layer", tokens=tokens, loop_us=times["torch loop"], fused_us=times["fused"],
                         speedup=times["torch loop"] / times["fused"], graphed_us=times["graphed"],
                         floor_us=floor_us, x_floor=times["graphed"] / floor_us, fp8_graphed_us=times["fp8_graphed"],
                         graphed_align_us=times["graphed_align"], graphed_pair_blocks_us=times["graphed_pair_blocks"],
                         graphed_stream_us=times["graphed_stream"], fp8_graphed_stream_us=times["fp8_graphed_stream"],
                         rel_err=err))
        print(f"layer tokens={tokens}: loop {times['torch loop']:.0f} us, fused {times['fused']:.0f} us", flush=True)


def part_decode(rt: Runtime, spec: ModelSpec, copy_bps: float, rows: list[dict]) -> None:
    for batch in (1, 8, 64):
        step = decode_step_seconds(rt.engine, batch, PROMPT_LEN, steps=32)
        active = step_bytes(spec, batch, all_experts=False) / copy_bps
        full = step_bytes(spec, batch, all_experts=True) / copy_bps
        rows.append(dict(part="decode", batch=batch, step_ms=step * 1e3, active_floor_ms=active * 1e3,
                         x_active_floor=step / active, full_floor_ms=full * 1e3, x_full_floor=step / full))
        print(f"decode batch {batch}: {step * 1e3:.2f} ms/step, active floor {active * 1e3:.2f} ms", flush=True)


def part_offline(rt: Runtime, spec: ModelSpec, copy_bps: float, requests: int, rows: list[dict]) -> None:
    rng, lens = throughput_workload(requests)
    warm_up(rt, lens, rng)
    prompts, params = offline_requests(rt, lens, rng)
    start = time.perf_counter()
    outs = rt.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # the floor of its decode work: each step reads the weights its batch touches; steps run at most
    # max_num_seqs requests, so the output tokens take at least out_tokens / max_num_seqs steps
    seqs = rt.engine.config.scheduler.max_num_seqs
    steps = out_tokens / seqs
    floor_s = steps * step_bytes(spec, seqs, all_experts=False, context=1100) / copy_bps
    rows.append(dict(part="offline", requests=requests, seconds=elapsed, output_tokens=out_tokens,
                     output_tokens_per_s=out_tokens / elapsed, decode_floor_s=floor_s, x_floor=elapsed / floor_s,
                     prompt_tokens=sum(i for i, _ in lens), preemptions=rt.engine.scheduler.num_preemptions))
    print(f"offline: {out_tokens / elapsed:.0f} output tok/s, {elapsed:.1f} s (decode floor {floor_s:.1f} s)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--parts", nargs="+", default=["layer", "decode", "offline"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    spec = ModelSpec.from_hf(preset_view(args.model))
    ceil = measure_ceilings()
    report: dict = dict(stamp=stamp(), model=args.model, copy_gb_per_s=ceil.copy_bytes_per_s / 1e9, rows=[], errors={})
    rows = report["rows"]

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    def attempt(name: str, fn, *fn_args) -> None:
        try:
            fn(*fn_args)
        except Exception as exc:  # noqa: BLE001 - recorded, the next part still runs
            traceback.print_exc()
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
        save()

    if "layer" in args.parts:
        attempt("layer", part_layer, spec, ceil.copy_bytes_per_s, rows)
        torch.cuda.empty_cache()
    if {"decode", "offline"} & set(args.parts):
        start = time.perf_counter()
        rt = None
        try:
            rt = Runtime(args.model, device="cuda", load_format="dummy")  # defaults otherwise
            rt.finish_background_compiles()
            report["build_s"] = time.perf_counter() - start
            report["level"] = rt.engine.config.compilation.level
            print(f"built in {report['build_s']:.1f}s", flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            report["errors"]["build"] = f"{type(exc).__name__}: {exc}"
        save()
        if rt is not None and "decode" in args.parts:
            attempt("decode", part_decode, rt, spec, ceil.copy_bytes_per_s, rows)
        if rt is not None and "offline" in args.parts:
            attempt("offline", part_offline, rt, spec, ceil.copy_bytes_per_s, args.requests, rows)
    print(report["stamp"], f"copy {report['copy_gb_per_s']:.0f} GB/s", f"build {report.get('build_s', 0):.0f} s")
    for part, cols in (("layer", ["tokens", "loop_us", "fused_us", "speedup", "graphed_us", "graphed_align_us",
                                  "graphed_pair_blocks_us", "graphed_stream_us", "floor_us", "x_floor",
                                  "fp8_graphed_us", "fp8_graphed_stream_us", "rel_err"]),
                       ("decode", ["batch", "step_ms", "active_floor_ms", "x_active_floor", "full_floor_ms",
                                   "x_full_floor"]),
                       ("offline", ["requests", "seconds", "output_tokens_per_s", "decode_floor_s", "x_floor",
                                    "preemptions"])):
        chosen = [r for r in rows if r["part"] == part]
        if chosen:
            print(table(cols, [[r.get(c, "") for c in cols] for r in chosen]))
    if report["errors"]:
        print("errors:", report["errors"])
    save()


main()
