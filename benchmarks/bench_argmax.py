"""Greedy argmax of a step's logits: ATen's `argmax` against kiln's split-row kernel (kiln/models/greedy_argmax.py),
per row count and vocabulary, inside a CUDA graph (GPU time) and eagerly (a call's wall time, the host's launch
included, as the sampler runs it). The row count up to which the kernel wins is KILN_ARGMAX_MAX_ROWS's default.

    python -m benchmarks.bench_argmax --json /tmp/argmax.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import eager_seconds, graphed_microseconds, stamp, table
from kiln.models.greedy_argmax_triton import row_max_triton

VOCABS = {"smollm2-135m": 49152, "llama3-8b": 128256, "qwen3-30b-a3b": 151936}


def measure(model: str, vocab: int, rows: int) -> dict:
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(row_max_triton(logits)[1], logits.argmax(dim=-1))
    return {"model": model, "vocab": vocab, "rows": rows,
            "aten_us": graphed_microseconds(lambda i: logits.argmax(dim=-1)),
            "kiln_us": graphed_microseconds(lambda i: row_max_triton(logits)),
            "aten_eager_us": eager_seconds(lambda: logits.argmax(dim=-1), 200) * 1e6,
            "kiln_eager_us": eager_seconds(lambda: row_max_triton(logits), 200) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--json")
    args = parser.parse_args()
    print(stamp())
    rows_out = [measure(model, vocab, rows) for model, vocab in VOCABS.items() for rows in args.rows]
    print(table(["model", "vocab", "rows", "ATen us (graph)", "kiln us (graph)", "ATen / kiln", "ATen us (eager)",
                 "kiln us (eager)"],
                [[r["model"], r["vocab"], r["rows"], r["aten_us"], r["kiln_us"], r["aten_us"] / r["kiln_us"],
                  r["aten_eager_us"], r["kiln_eager_us"]] for r in rows_out]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stamp": stamp(), "rows": rows_out}, f, indent=1)


main()
