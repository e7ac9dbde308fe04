#!/usr/bin/env bash
# 2026-11-30's tenth session, second call on nvidia-h200-x2 (~6 minutes), issue 16: a mixed step's leading
# decodes in the split-KV decode kernel instead of the varlen kernel (s10a's profile: the varlen kernel is
# ~20 ms of a ~200 ms prefill-carrying step, and each decode row there costs a whole q-tile).
#   GPU 0: bench_attention --mixed (old path, split, varlen tile sweep on mixed steps), then the GPU tests of
#          the attention kernels (the new "leading decodes" case);
#   GPU 1: offline throughput at default settings (now with the split), interleaved in one process with the
#          old path (--ab varlen_mixed_decodes, since renamed attention_before and extended to the old tile), 4 runs.
set -u
source benchmarks/gpu_call.sh
( CUDA_VISIBLE_DEVICES=0 bounded "$(left 200)" python3 -m benchmarks.bench_attention --mixed \
    --json $R/s10b_attn_mixed.json > $L/gpu0_attn_mixed.log 2>&1
  CUDA_VISIBLE_DEVICES=0 bounded "$(left 330)" python3 -m pytest -q -p no:cacheprovider -rfE -x \
    tests/gpu/test_attention_backends.py tests/attention/test_triton_kernels.py > $L/gpu0_attn_tests.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 330)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton \
    --repeats 4 --ab varlen_mixed_decodes --json $R/s10b_offline_ab.json > $L/gpu1_offline_ab.log 2>&1 &
wait
finish_call 16
