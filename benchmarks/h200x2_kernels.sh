#!/usr/bin/env bash
# One call on nvidia-h200-x2 (2026-11-30, fourth session), about 5 minutes:
# GPU 0: the small-M GEMM sweep (FP8 and bf16 Triton vs cuBLAS, Llama-3-8B projections and their TP=2 shards),
#        then FP8 decode on the Triton path (the rule's configs, before TUNED is filled);
# GPU 1: the FP8 kernel tests on the GPU, then start-up with the pinned staging loader (cold, warm).
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 215)" python3 -m benchmarks.bench_fp8 --parts kernels --kernel-tp 2 --kernel-budget-s 170 \
     --json $R/kernels.json
  bounded "$(left 320)" python3 -m benchmarks.bench_fp8 --parts decode --no-bf16 --fp8-paths triton \
     --batches 1 8 64 --max-num-seqs 64 --requests 0 --json $R/fp8_decode.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 150)" python3 -m pytest -q -p no:cacheprovider -rfE tests/models/test_fp8_kernel.py \
     tests/gpu/test_fp8_gpu.py
  bounded "$(left 320)" python3 -m benchmarks.bench_startup --variants default --budget-s 300 \
     --start-timeout-s 150 --decode-batches 1 --json $R/startup.json
) > $L/gpu1.log 2>&1 &
wait
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
tail -n 45 $L/gpu0.log; tail -n 25 $L/gpu1.log
echo "total $(( $(date +%s) - T0 )) s"
