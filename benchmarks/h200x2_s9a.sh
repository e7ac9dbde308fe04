#!/usr/bin/env bash
# 2026-11-30's ninth session, first call on nvidia-h200-x2 (~7 minutes), issue 14:
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint at default settings, three GIL switch
#   intervals during start-up (0.5 ms, the new default; 5 ms, Python's and the old behaviour; 0.1 ms): a cold
#   and a warm start each, a second warm round taking turns, then one warm start each with its main thread
#   sampled every 5 ms (where a warm start's seconds go).
#   Then the tensor-parallel GPU tests (both GPUs: worker ranks start under the same hand-off).
# Results and logs go straight to $OUT, so a call cut short by the device budget still returns them.
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 330)" python3 -m benchmarks.bench_startup --budget-s 320 \
   --variants default "KILN_STARTUP_SWITCH_INTERVAL_MS=5" "KILN_STARTUP_SWITCH_INTERVAL_MS=0.1" \
   --warm-repeats 2 --sample-warm --json $OUT/startup_gil.json > $OUT/startup.log 2>&1
grep "kiln ready\|checkpoint:\|start \.\.\.\|exit" $OUT/startup.log | tail -n 30
cp -r $OUT/startup_gil.logs/*.sample.txt $OUT/ 2>/dev/null
bounded "$(left 480)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   > $OUT/tp_tests.log 2>&1
tail -3 $OUT/tp_tests.log
echo "total $(( $(date +%s) - T0 )) s"
