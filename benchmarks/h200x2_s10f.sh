#!/usr/bin/env bash
# 2026-11-30's tenth session, sixth call on nvidia-h200-x2 (~4 minutes), issue 14: s10e's warm starts with the
# remembered triton_key had a shorter compile phase but a longer capture phase. The key now replaces every binding
# of Triton's function (any module, not a fixed list); the same A/B (default vs KILN_TRITON_KEY_MEMO=0), one cold
# and one warm start each, every start sampled every 5 ms to see where the capture phase goes. GPU 0, host quiet.
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 KILN_BENCH_SAMPLE=1 bounded "$(left 270)" python3 -m benchmarks.bench_startup --budget-s 260 \
   --variants default "KILN_TRITON_KEY_MEMO=0" --decode-batches 1 \
   --json $R/s10f_startup_triton_key.json > $L/startup.log 2>&1
grep "kiln ready\|checkpoint:\|start \.\.\.\|exit" $L/startup.log | tail -n 10
for f in $R/s10f_startup_triton_key.logs/*warm*.sample.txt; do cp "$f" "$OUT/$(basename "$f" | tr "=" "_")"; done
finish_call 4
