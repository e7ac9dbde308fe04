#!/usr/bin/env bash
# 2026-11-30's ninth session, second call on nvidia-h200-x2 (~3 minutes), issue 14 diagnosis: where a start's
# main thread spends its wall time. GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint at default
# settings, a cold and two warm starts, every one sampled every 5 ms (KILN_BENCH_SAMPLE=1, stack_sampler.py).
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 KILN_BENCH_SAMPLE=1 bounded "$(left 230)" python3 -m benchmarks.bench_startup --budget-s 220 \
   --variants default --warm-repeats 2 --decode-batches 1 --json $R/startup_sampled.json > $L/startup.log 2>&1
grep "kiln ready\|checkpoint:\|start \.\.\.\|exit" $L/startup.log | tail -n 12
cp $R/startup_sampled.json $OUT/
for f in $R/startup_sampled.logs/*.sample.txt; do cp "$f" $OUT/; done
for f in $R/startup_sampled.logs/default-*.log; do grep -v "Warning\|warn\|size/s\]" "$f" | cut -c1-220 > $OUT/$(basename $f); done
echo "total $(( $(date +%s) - T0 )) s"
