#!/usr/bin/env bash
# 2026-11-30's tenth session, first call on nvidia-h200-x2 (~7 minutes), issue 16's offline gap (9.7-9.96k of
# 10k tok/s): GPU 0 profiles the offline workload's prefill-carrying steps (after 2 steps) and its steady
# decode with ~250 running (after 60), then reruns tests/gpu/test_cuda_graphs.py alone (the ninth session's
# s9e did not see it finish in 170 s); GPU 1 times cuBLAS against Inductor's max-autotuned Triton GEMMs at
# M = 64..256 on the 8B projections.
set -u
source benchmarks/gpu_call.sh
( CUDA_VISIBLE_DEVICES=0 bounded "$(left 200)" python3 -m benchmarks.bench_profile --configs llama3-8b:1:bf16 \
    --offline-requests 256 --offline-at 2 60 --steps 5 --batches 256 --json $R/s10a_profile_offline.json \
    > $L/gpu0_profile.log 2>&1
  CUDA_VISIBLE_DEVICES=0 bounded "$(left 450)" python3 -m pytest -q -p no:cacheprovider -rfE --durations=8 \
    tests/gpu/test_cuda_graphs.py > $L/gpu0_cuda_graph_tests.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 400)" python3 -m benchmarks.bench_gemm_mid_m --m 256 128 192 64 \
    --budget-s 300 --json $R/s10a_gemm_mid_m.json > $L/gpu1_gemm.log 2>&1 &
wait
finish_call 30
