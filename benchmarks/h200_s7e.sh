#!/usr/bin/env bash
# 2026-11-30's seventh session, a last short call (~5 minutes, the device time left), one GPU: the cold-start A/B of
# the kernel warm-up thread (kiln's Triton kernels compiled beside the compile phase, kiln/runtime/kernel_warmup.py):
# start-up from the on-disk 8B checkpoint, cold then warm, with it (default) and cold without (KILN_KERNEL_WARMUP=0,
# fresh caches); then the CUDA-graph GPU test (graphed tokens == eager) with it on.
set -u
source benchmarks/gpu_call.sh
export CUDA_VISIBLE_DEVICES=0
bounded "$(left 130)" env -u PYTHONDONTWRITEBYTECODE python3 -m benchmarks.bench_startup --variants default \
   --budget-s 120 --json $R/startup_kernel_warmup.json > $L/startup_on.log 2>&1
bounded "$(left 205)" env -u PYTHONDONTWRITEBYTECODE KILN_KERNEL_WARMUP=0 python3 -m benchmarks.bench_startup \
   --variants default --decode-batches --budget-s 70 --json $R/startup_no_kernel_warmup.json > $L/startup_off.log 2>&1
bounded "$(left 285)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_cuda_graphs.py > $L/graph_test.log 2>&1
finish_call 8
