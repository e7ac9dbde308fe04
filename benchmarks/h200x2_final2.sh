#!/usr/bin/env bash
# 2026-11-30's fifth session, third call on nvidia-h200-x2 (~8.5 minutes):
#   GPU 0 alone (no other process competing for the host's cores): start-up cold/warm from the on-disk 8B
#          checkpoint (parallel preadv loader), then bench_load (CUDA context, parameter allocation, read rates);
#   then side by side: GPU 0 the FP8 GPU tests; GPU 1 the offline workload profiled mid-run (bf16 defaults);
#   both:  the tensor-parallel GPU tests in one process (the second TP runtime used to hang: stale
#          symmetric-memory registration; now the ranks agree on NCCL), every rank dumping stacks every 60 s.
set -u
source benchmarks/gpu_call.sh
export CUDA_VISIBLE_DEVICES=0
bounded "$(left 175)" env -u PYTHONDONTWRITEBYTECODE python3 -m benchmarks.bench_startup --variants default \
   --budget-s 170 --json $R/startup.json > $L/startup.log 2>&1
bounded "$(left 205)" python3 -m benchmarks.bench_load /tmp/kiln-bench-startup/llama3-8b-bf16 --json $R/load.json \
   > $L/load.log 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 340)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8_gpu.py
) > $L/fp8_tests.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 340)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:bf16 --offline-requests 256 \
     --batches 256 --json $R/profile_offline.json
) > $L/offline_profile.log 2>&1 &
wait
unset CUDA_VISIBLE_DEVICES
bounded "$(left 525)" env KILN_DUMP_STACKS_AFTER=60 python3 -m pytest -q -s -p no:cacheprovider -rfE \
   tests/gpu/test_tensor_parallel_gpu.py > $L/tp_tests.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr" "$f" | tail -n 12; done
echo "total $(( $(date +%s) - T0 )) s"
