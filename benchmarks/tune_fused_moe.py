"""Regenerates kiln/models/fused_moe/configs/h200.json: the fused MoE kernels' launch configuration per layer
shape and token-count bucket, the fastest of a small candidate set on this GPU (the op's Triton path on random
routing, timed inside a CUDA graph as kiln runs it, weight copies rotated so that none is served from L2).

    python -m benchmarks.tune_fused_moe --out kiln/models/fused_moe/configs/h200.json   # Qwen3-30B-A3B shape
    python -m benchmarks.tune_fused_moe --shape 8,14336,4096,2 --out mixtral.json        # E,N,K,top_k

The output merges into an existing --out file (other shapes, and buckets not swept, kept). --budget-s stops the
sweep early, writing what it has (buckets it did not reach keep the file's entry, else take the rule in
configs.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import graphed_microseconds, stamp, table
from kiln.models.fused_moe.configs import MoeKernelConfig, heuristic, shape_key
from kiln.models.fused_moe.kernels import fused_moe_triton

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# the pair kernels accumulate a [rows, BLOCK_K] tile element-wise: a few rows and 4-16 KB of weight a step (the
# streaming matrix-vector kernel's shapes, kiln/models/gemv_stream.py; the larger steps for GPUs of more bandwidth)
PAIR_CANDIDATES = [MoeKernelConfig(1, bn, bk, w, s) for bn, bk, w, s in
                   ((2, 1024, 4, 3), (4, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 3), (16, 128, 4, 3), (8, 512, 4, 3),
                    (16, 256, 4, 3), (4, 1024, 8, 3), (8, 1024, 8, 3), (16, 512, 8, 3), (2, 2048, 4, 3))]
GROUPED_CANDIDATES = [MoeKernelConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in
                      ((16, 32, 128, 4, 4), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 128, 64, 4, 3),
                       (32, 64, 64, 4, 4), (32, 128, 64, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 8, 3),
                       (64, 128, 64, 4, 4), (128, 128, 64, 8, 3))]


def candidates(tokens: int, top_k: int, num_experts: int) -> list[MoeKernelConfig]:
    pairs = tokens * top_k
    grouped = [c for c in GROUPED_CANDIDATES if c.block_m <= max(16, 2 * pairs)]
    pair = PAIR_CANDIDATES if pairs <= 4 * num_experts else []
    return pair + grouped


def time_config(x, weights, tw, ids, config: MoeKernelConfig) -> float:
    """us per call inside a CUDA graph (as kiln runs it), the weight copies rotated so L2 holds none."""
    return graphed_microseconds(
        lambda i: fused_moe_triton(x, *weights[i % len(weights)], tw, ids, config=config), calls=2 * len(weights))


def routing(tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="128,768,2048,8", help="E,N,K,top_k (N: per-rank expert intermediate)")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(BUCKETS))
    parser.add_argument("--budget-s", type=float, default=110.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    num_experts, inter, hidden, top_k = (int(v) for v in args.shape.split(","))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    # several copies of the weights, rotated, so a measurement does not run out of L2
    copies = max(1, min(4, int(8e9 // (num_experts * 3 * inter * hidden * 2))))
    weights = [(torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype) * 0.02,
                torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype) * 0.02) for _ in range(copies)]
    start = time.perf_counter()
    chosen: dict[str, dict] = {}
    rows = []
    for bucket in args.buckets:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent: buckets from {bucket} on not tuned", flush=True)
            break
        x = torch.randn(bucket, hidden, device="cuda", dtype=dtype)
        tw, ids = routing(bucket, num_experts, top_k, bucket)
        timings = {}
        for config in candidates(bucket, top_k, num_experts):
            try:
                timings[config] = time_config(x, weights, tw, ids, config)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: not a candidate here
                print(f"  {bucket} {config}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        for config, us in sorted(timings.items(), key=lambda item: item[1]):
            print(f"  {bucket} {tuple(config.to_json().values())}: {us:.1f} us", flush=True)
        if not timings:
            continue
        best = min(timings, key=timings.get)
        rule = heuristic(num_experts, top_k, bucket)
        rule_us = timings.get(rule) or time_config(x, weights, tw, ids, rule)
        chosen[str(bucket)] = best.to_json()
        rows.append([bucket, str(tuple(best.to_json().values())), timings[best], rule_us, rule_us / timings[best]])
        print(f"tokens {bucket}: best {best} {timings[best]:.1f} us (rule {rule_us:.1f} us)", flush=True)
    out = Path(args.out)
    table_json = json.loads(out.read_text()) if out.is_file() else {}
    configs = table_json.setdefault("configs", {})
    key = shape_key(num_experts, inter, hidden, top_k, dtype)
    configs[key] = dict(sorted({**configs.get(key, {}), **chosen}.items(), key=lambda item: int(item[0])))
    source = f"python -m benchmarks.tune_fused_moe --shape {args.shape} --buckets {' '.join(chosen)} ({stamp()})"
    previous = table_json.get("source", "").split("; other buckets: ")[-1]
    table_json["source"] = f"{source}; other buckets: {previous}" if previous and len(chosen) < len(BUCKETS) else source
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table_json, indent=1) + "\n")
    print(table(["tokens", "best (bm, bn, bk, warps, stages)", "best us", "rule us", "rule / best"], rows))


main()
