#!/usr/bin/env bash
# 2026-11-30's tenth session, fourth call on nvidia-h200-x2 (~6 minutes), diagnosis for the next session:
#   GPU 0, host otherwise quiet (issue 14): a cold and two warm starts from the on-disk 8B checkpoint at default
#          settings, every one sampled every 5 ms (the ninth session's s9b map predates the remembered torch_key
#          and the warm-up process);
#   then GPU 1 (issue 17): where an FP8 and a bf16 decode step go now (torch.profiler, batch 1 and 64).
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 KILN_BENCH_SAMPLE=1 bounded "$(left 230)" python3 -m benchmarks.bench_startup --budget-s 220 \
   --variants default --warm-repeats 2 --decode-batches 1 --json $R/s10d_startup_sampled.json > $L/startup.log 2>&1
grep "kiln ready\|checkpoint:\|start \.\.\.\|exit" $L/startup.log | tail -n 12
for f in $R/s10d_startup_sampled.logs/*.sample.txt; do cp "$f" $OUT/; done
CUDA_VISIBLE_DEVICES=1 bounded "$(left 400)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:fp8 \
   llama3-8b:1:bf16 --batches 1 64 --steps 12 --json $R/s10d_profile_fp8.json > $L/profile.log 2>&1
finish_call 12
