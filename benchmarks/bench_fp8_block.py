"""The block-scaled FP8 GEMM (kiln/models/quant/fp8_block.py, activations quantized per 1 x 128 block inside the
GEMM) against what an FP8 decode step runs today: the per-token quantization kernel (Inductor's, compiled from
kiln's torch code) then kiln's per-token FP8 GEMM. Per projection and M, us, each timed inside a CUDA graph whose
calls rotate over more weight than L2 holds (bench_gemm's method); the block kernel at the per-token config's tile
made one block deep and at every swept tile with a 128-wide K step.

    python -m benchmarks.bench_fp8_block --json fp8_block.json                                  # H200: ~2 min
    python -m benchmarks.bench_fp8_block --preset tiny-llama --device cpu --m 1 --json /tmp/b.json  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.bench_gemm import ROTATE_BYTES, candidate_tiles, graph_time_us, projection_shapes, sweep_configs
from benchmarks.common import stamp, table


def block_tiles() -> list[Any]:
    """bench_gemm's tiles with the K step one block (128) deep, duplicates dropped."""
    seen = {(t.block_n, t.num_warps, t.num_stages): t for t in candidate_tiles()}
    return [type(t)(t.block_n, 128, 1, t.num_warps, t.num_stages) for t in seen.values()]


def projection_rows(proj: str, n: int, k: int, ms: list[int], device: str) -> list[dict]:
    from kiln.models.quant.fp8 import quantize_per_token, quantize_weight

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copies = max(1, math.ceil(ROTATE_BYTES / (n * k))) if device == "cuda" else 1
    wq, ws = quantize_weight(torch.randn(n, k, device=device, dtype=dtype) * 0.02)
    weights = [(wq.clone(), ws) for _ in range(copies)]  # distinct storage, each streamed from HBM
    quant = torch.compile(quantize_per_token, dynamic=False) if device == "cuda" else quantize_per_token
    rows = []
    for m in ms:
        rows.append(dict(proj=proj, N=n, K=k, M=m) | m_row(torch.randn(m, k, device=device, dtype=dtype), weights,
                                                           quant))
        print({key: value for key, value in rows[-1].items() if key != "block_sweep"}, flush=True)
    return rows


def m_row(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], quant) -> dict[str, Any]:
    from kiln.models.quant.fp8_block import block_config, fp8_block_gemm_triton
    from kiln.models.quant.fp8_kernel import fp8_gemm_triton

    (m, k), n, device = x.shape, weights[0][0].shape[0], x.device.type
    xq, xs = quant(x)

    def quant_gemm(w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, s = quant(x)
        return fp8_gemm_triton(q, w[0], s, w[1], x.dtype)

    row = dict(quant_us=graph_time_us([lambda: quant(x)], device),
               gemm_us=graph_time_us([lambda w=w: fp8_gemm_triton(xq, w[0], xs, w[1], x.dtype) for w in weights],
                                     device),
               quant_gemm_us=graph_time_us([lambda w=w: quant_gemm(w) for w in weights], device))
    swept = []
    for config in [block_config(m, n, k, x.device), *sweep_configs(m, n, k, block_tiles)]:
        us = graph_time_us([lambda w=w, c=config: fp8_block_gemm_triton(x, w[0], w[1], x.dtype, c)
                            for w in weights], device)
        swept.append((us, asdict(config)))
    best = min(swept, key=lambda s: s[0])
    return row | dict(block_auto_us=swept[0][0], block_auto_config=swept[0][1], block_best_us=best[0],
                      block_best_config=best[1], block_sweep=swept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--projections", nargs="+", choices=["qkv", "o", "gate_up", "down"],
                        default=["o", "down", "qkv", "gate_up"])
    parser.add_argument("--budget-s", type=float, default=200.0, help="no new projection after this")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    print(stamp(), flush=True)
    shapes = projection_shapes(args.preset)
    start, rows, skipped = time.perf_counter(), [], []
    for proj in args.projections:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(proj)
            continue
        k, n = shapes[proj]
        rows += projection_rows(proj, n, k, args.m, args.device)
    cfg = (lambda c: f"{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}")
    print(table(["proj", "M", "quant us", "gemm us", "quant + gemm us", "block auto us", "block best us",
                 "best config", "block best / gemm", "block best / (quant + gemm)"],
                [[r["proj"], r["M"], r["quant_us"], r["gemm_us"], r["quant_gemm_us"], r["block_auto_us"],
                  r["block_best_us"], cfg(r["block_best_config"]), r["block_best_us"] / r["gemm_us"],
                  r["block_best_us"] / r["quant_gemm_us"]] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "args": vars(args), "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
