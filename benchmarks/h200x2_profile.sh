#!/usr/bin/env bash
# Diagnose before optimising (2026-11-30, second session), one call on nvidia-h200-x2, about 9 minutes:
# GPU 0: where the 8B bf16 step goes at decode batch 1/64/256 and mid-way through the offline workload
#        (bench_profile), then a cProfile'd cold and warm start (bench_startup, KILN_BENCH_PROFILE=1);
# GPU 1: the online serving table owed since 2026-11-30 (bench_serve), then the FP8 decode profile;
# both: the TP=2 decode profile (rank 0). JSON and logs (with the start-up profiles) come back in $OUT.
set -u
source benchmarks/gpu_call.sh
nvidia-smi --query-gpu=name,memory.used --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 170)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:bf16 --offline-requests 256 \
     --batches 1 64 256 --json $R/profile_bf16.json --trace-dir $R/traces
  KILN_BENCH_PROFILE=1 bounded "$(left 390)" python3 -m benchmarks.bench_startup --variants default \
     --budget-s 210 --start-timeout-s 130 --decode-batches 1 --json $R/startup.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 250)" python3 -m benchmarks.bench_serve --model llama3-8b --ready-timeout 150 \
     --num-prompts 16 48 128 192 --json $R/serve.json
  bounded "$(left 380)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:fp8 --batches 1 64 \
     --json $R/profile_fp8.json
) > $L/gpu1.log 2>&1 &
wait
bounded "$(left 540)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 \
   --json $R/profile_tp2.json --trace-dir $R/traces > $L/tp.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp --exclude=res/traces res logs 2>/dev/null
tar czf "$OUT"/traces.tgz -C /tmp/res traces 2>/dev/null
ls -la "$OUT"; tail -n 25 $L/*.log
echo "total $(( $(date +%s) - T0 )) s"
