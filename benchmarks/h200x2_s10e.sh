#!/usr/bin/env bash
# 2026-11-30's tenth session, fifth call on nvidia-h200-x2 (~4.5 minutes), issue 14: Triton's triton_key
# remembered under the cache root (s10d's sampler: 1.4 s of a 10.9 s warm start). GPU 0, host otherwise quiet:
# start-up from the on-disk 8B checkpoint, default vs KILN_TRITON_KEY_MEMO=0, a cold start each and two warm
# starts each, the variants taking turns.
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 330)" python3 -m benchmarks.bench_startup --budget-s 320 \
   --variants default "KILN_TRITON_KEY_MEMO=0" --warm-repeats 2 --decode-batches 1 \
   --json $R/s10e_startup_triton_key.json > $L/startup.log 2>&1
grep "kiln ready\|checkpoint:\|start \.\.\.\|exit" $L/startup.log | tail -n 14
finish_call 6
