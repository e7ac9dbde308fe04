#!/usr/bin/env bash
# 2026-11-30's ninth session, fifth call on nvidia-h200-x2 (~2.5 minutes): the merged code on the GPU paths it
# touches: compile workers (a tracked spawn context, cancel at shutdown and exit), the compile cache's warm
# start, CUDA graphs; GPU 0 and GPU 1 side by side.
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 170)" python3 -m pytest -q -p no:cacheprovider -rfE \
   tests/gpu/test_compile_cache_gpu.py tests/gpu/test_kv_profile_gpu.py > $OUT/gpu0_tests.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 170)" python3 -m pytest -q -p no:cacheprovider -rfE \
   tests/gpu/test_cuda_graphs.py > $OUT/gpu1_tests.log 2>&1 &
wait
tail -n 4 $OUT/gpu0_tests.log $OUT/gpu1_tests.log
echo "total $(( $(date +%s) - T0 )) s"
