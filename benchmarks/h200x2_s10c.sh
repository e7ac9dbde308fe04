#!/usr/bin/env bash
# 2026-11-30's tenth session, third call on nvidia-h200-x2 (~6 minutes), issue 16, the attention changes as
# shipped (a mixed step's >= 32 leading decodes in the decode kernel; varlen tile 64 rows x 64 keys, 4 warps):
#   GPU 0: bench_attention --mixed: before / split at the old tile / defaults / a few tiles, on mixed steps and
#          long prefills (8 x 4096, 1 x 8192); then the attention GPU tests;
#   GPU 1: offline throughput at default settings interleaved in one process with the old attention
#          (--ab attention_before), 4 runs, then transformers on the first 64 requests (the baseline).
set -u
source benchmarks/gpu_call.sh
( CUDA_VISIBLE_DEVICES=0 bounded "$(left 150)" python3 -m benchmarks.bench_attention --mixed \
    --tiles 64,64,4,2 64,32,4,2 64,64,4,3 128,32,4,3 --json $R/s10c_attn_mixed.json > $L/gpu0_attn_mixed.log 2>&1
  CUDA_VISIBLE_DEVICES=0 bounded "$(left 330)" python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/gpu/test_attention_backends.py tests/attention/test_triton_kernels.py tests/gpu/test_async_scheduling_gpu.py \
    > $L/gpu0_tests.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 420)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton \
    --repeats 4 --ab attention_before --hf --hf-requests 64 --hf-batch 64 --hf-max-seconds 90 \
    --json $R/s10c_offline.json > $L/gpu1_offline.log 2>&1 &
wait
finish_call 16
