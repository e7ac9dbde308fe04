#!/usr/bin/env bash
# 2026-11-30's seventh session, last call on nvidia-h200-x2 (~8 minutes):
#   GPU 0 alone (host quiet): start-up from the on-disk 8B checkpoint at default settings, cold then warm, with
#          the compile workers started before Dynamo's trace (issue 14; s7c measured 51.9 / 16.3 s without);
#   then the GPU tests the session's default changes touch (PIECEWISE graph grid, remembered KV peak,
#          prespawned compile workers, the decode merge, the fixed cache-writing RoPE kernel): one GPU each,
#          then tensor parallelism (TP=2 greedy == TP=1 with graphs) on both.
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 150)" env -u PYTHONDONTWRITEBYTECODE python3 -m benchmarks.bench_startup --variants default \
     --budget-s 140 --json $R/startup_prespawn.json > $L/startup.log 2>&1
  bounded "$(left 330)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_cuda_graphs.py \
     tests/gpu/test_compile_cache_gpu.py tests/gpu/test_kv_profile_gpu.py tests/passes/test_kernels.py \
     > $L/gpu_tests0.log 2>&1
) &
(
  sleep "$(left 150)"
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 330)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_async_scheduling_gpu.py \
     tests/gpu/test_attention_backends.py tests/attention/test_triton_kernels.py > $L/gpu_tests1.log 2>&1
) &
wait
bounded "$(left 590)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   tests/gpu/test_tp_allreduce_gpu.py > $L/tp_tests.log 2>&1
finish_call 8
