#!/usr/bin/env bash
# 2026-11-30's eighth session, first call on nvidia-h200-x2 (~9.5 minutes):
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint, cold and warm, the new -O2 plan (exact
#          decode sizes compiled after ready, swapped in with their graphs re-captured) against the old one
#          (the same sizes up front: compile_sizes=1,2,4,8), decode after the swap (issue 14);
#          GPU 1 meanwhile: the GPU tests of CUDA graphs, the new background swap among them;
#   then GPU 0: offline throughput at default settings, and the same with Inductor's combo kernels (issue 16);
#        GPU 1: decode batch 1/8/64 and prefill 1024, Inductor's combo kernels vs not, one process (bench_passes).
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 285)" python3 -m benchmarks.bench_startup --variants default "compile_sizes=1,2,4,8" \
     --budget-s 275 --json $R/startup_background_ab.json
) > $L/startup.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 200)" python3 -m pytest -q -p no:cacheprovider -rfE -s tests/gpu/test_cuda_graphs.py
) > $L/graph_tests.log 2>&1 &
wait
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 430)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 \
     --json $R/offline_defaults.json
  bounded "$(left 585)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 \
     --inductor-option combo_kernels=true --json $R/offline_combo.json
) > $L/offline.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 585)" python3 -m benchmarks.bench_passes --preset llama3-8b --backend triton \
     --configs default combo_kernels --batches 1 8 64 --prefill 1024 --json $R/combo_passes.json
) > $L/combo_passes.log 2>&1 &
wait
finish_call 12
