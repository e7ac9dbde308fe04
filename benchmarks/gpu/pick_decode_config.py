"""The decode launch configuration that `bench_attention --sweep` JSON files found best from batch 8 on: the lowest
geometric mean of its time over the default's across those shapes, among the configurations within 2% of the
default at every batch-1 shape and exact (the sweep's error check). Prints KILN_DECODE_CONFIG's value for it
("" when the default is best), for an end-to-end A/B in the same call.

    python3 benchmarks/gpu/pick_decode_config.py SWEEP.json [SWEEP.json ...]
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def pick(paths: list[str]) -> str:
    ratios: dict[tuple, list[float]] = defaultdict(list)
    excluded: set[tuple] = set()  # inexact anywhere, or over 2% slower at a batch-1 shape
    default: dict = {}
    for path in paths:
        data = json.load(open(path))
        default = data["default"]  # the backend's decode_cfg: its keys are the knobs a result row carries
        base = {}
        for row in data["results"]:
            shape, cfg = (tuple(row["heads"]), row["batch"], row["ctx"]), tuple(row.get(k) for k in default)
            base.setdefault(shape, row["us"])  # the default configuration is timed first at every shape
            ratio = row["us"] / base[shape]
            if row["err"] >= 2e-2 or (row["batch"] == 1 and ratio > 1.02):
                excluded.add(cfg)
            elif row["batch"] > 1:
                ratios[cfg].append(ratio)
    scores = {cfg: math.exp(sum(map(math.log, r)) / len(r)) for cfg, r in ratios.items() if cfg not in excluded}
    for cfg, score in sorted(scores.items(), key=lambda kv: kv[1])[:5]:
        print(f"{score:.3f} {dict(zip(default, cfg))}", file=sys.stderr)
    best = min(scores, key=scores.get)
    return ":".join(f"{k}={v}" for (k, d), v in zip(default.items(), best) if v != d)


if __name__ == "__main__":
    print(pick(sys.argv[1:]))
