#!/usr/bin/env bash
# 2026-11-30's fifth session, last call (nvidia-h200, ~5 minutes): TunableOp vs cuBLAS heuristics on the offline workload.
set -u
source benchmarks/gpu_call.sh
bounded "$(left 330)" python3 -m benchmarks.bench_tunable --json $R/tunable.json > $L/tunable.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]" $L/tunable.log | tail -n 30
echo "total $(( $(date +%s) - T0 )) s"
