#!/usr/bin/env bash
# 2026-11-30's ninth session, fourth call on nvidia-h200-x2 (~6 minutes), issue 14:
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint at default settings (cold, then two warm
#   starts, which now start no kernel warm-up: their compile cache is ready).
#   Then the tensor-parallel GPU tests (both GPUs): s9c's run stalled there because a daemonic rank could not
#   start the warm-up process; ranks now run the plan on a thread.
# Results and logs go straight to $OUT, so a call cut short by the device budget still returns them.
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 200)" python3 -m benchmarks.bench_startup --budget-s 190 \
   --variants default --warm-repeats 2 --decode-batches 1 8 64 --json $OUT/startup_final.json > $OUT/startup.log 2>&1
grep "kiln ready\|checkpoint:\|exit" $OUT/startup.log | tail -n 6
bounded "$(left 380)" python3 -m pytest -q -p no:cacheprovider -rfE -o faulthandler_timeout=120 \
   tests/gpu/test_tensor_parallel_gpu.py > $OUT/tp_tests.log 2>&1
tail -n 3 $OUT/tp_tests.log
echo "total $(( $(date +%s) - T0 )) s"
