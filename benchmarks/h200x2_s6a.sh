#!/usr/bin/env bash
# 2026-11-30's sixth session, first call on nvidia-h200-x2 (~9.5 minutes):
#   side by side: GPU 0 the Triton decode attention's split floor (min_tiles) and waves at 8B heads and at a
#                 70B TP=2 rank's heads, then the 8B TP=1 bf16 and FP8 step profiles at batch 1 / 64;
#                 GPU 1 the offline workload at default settings with the transformers baseline (issue 16);
#   then both: the tensor-parallel GPU tests (the greedy-local path is new since they last ran), and the TP=2
#              step profiles of 8B (with rank 0's host cProfile) and 70B at batch 1 / 64 (issue 15).
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 130)" python3 -m benchmarks.bench_attention --sweep --vary min_tiles waves --batches 1 8 32 \
     --contexts 160 600 2048 --json $R/attn_min_tiles_tp1.json
  bounded "$(left 200)" python3 -m benchmarks.bench_attention --sweep --vary min_tiles waves --heads 32 4 \
     --batches 1 8 --contexts 160 600 2048 --json $R/attn_min_tiles_70b_tp2.json
  bounded "$(left 300)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:bf16 llama3-8b:1:fp8 \
     --batches 1 64 --json $R/profile_tp1.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 300)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --hf --hf-requests 64 \
     --hf-batch 64 --hf-max-seconds 90 --json $R/offline_defaults.json
) > $L/gpu1.log 2>&1 &
wait
bounded "$(left 400)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   > $L/tp_tests.log 2>&1
bounded "$(left 485)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 --host \
   --json $R/profile_8b_tp2.json > $L/tp_8b.log 2>&1
bounded "$(left 590)" python3 -m benchmarks.bench_profile --configs llama3-70b:2:bf16 --batches 1 64 \
   --json $R/profile_70b_tp2.json > $L/tp_70b.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr" "$f" | tail -n 14; done
echo "total $(( $(date +%s) - T0 )) s"
