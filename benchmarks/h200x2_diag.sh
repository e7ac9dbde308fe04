#!/usr/bin/env bash
# 2026-11-30's fifth session, first call on nvidia-h200-x2 (~9 minutes):
#   GPU 0: Llama-3-8B at default settings, bf16 and FP8: decode b1/8/64 and the offline workload with its step
#          timeline (bench_fp8 --defaults); then the Triton decode attention sweep on offline-like mixed contexts
#          (longest-first launch order on/off);
#   GPU 1: the FP8 GPU tests (compiled == eager after emulate_precision_casts), start-up cold/warm from an on-disk
#          checkpoint (parallel preadv loader), and the loader A/B (bench_load);
#   both:  the tensor-parallel GPU tests (TP=2 == TP=1 with graphs, shutdown), then the TP=2 8B profile with a
#          cProfile of rank 0's host.
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 250)" python3 -m benchmarks.bench_fp8 --defaults --parts decode throughput --bf16-paths triton \
     --fp8-paths triton --batches 1 8 64 --requests 256 --json $R/defaults.json
  bounded "$(left 345)" python3 -m benchmarks.bench_attention --sweep --varlen 100 2048 --batches 128 256 \
     --json $R/attn_varlen.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 100)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8_gpu.py
  bounded "$(left 300)" env -u PYTHONDONTWRITEBYTECODE python3 -m benchmarks.bench_startup --variants default \
     --budget-s 190 --json $R/startup.json
  bounded "$(left 345)" python3 -m benchmarks.bench_load /tmp/kiln-bench-startup/llama3-8b-bf16 --json $R/load.json
) > $L/gpu1.log 2>&1 &
wait
bounded "$(left 480)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py > $L/tp_tests.log 2>&1
bounded "$(left 585)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 --host \
   --json $R/profile_tp2.json > $L/tp_profile.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]" "$f" | tail -n 14; done
echo "total $(( $(date +%s) - T0 )) s"
