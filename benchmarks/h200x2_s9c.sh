#!/usr/bin/env bash
# 2026-11-30's ninth session, third call on nvidia-h200-x2 (~7 minutes), issue 14:
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint, cold and warm (a second warm round taking
#   turns): the new default (kiln's Triton kernels compiled in a warm-up process, not a thread; Inductor's torch_key
#   remembered in the cache), KILN_TORCH_KEY_MEMO=0 (torch_key walked in every process, as before), and
#   KILN_KERNEL_WARMUP=0 (no kernel warm-up: what it buys now).
#   Then the GPU tests the change touches: CUDA graphs (GPU 1) and compile cache + KV profiling (GPU 0) side by
#   side, then tensor parallelism (both GPUs: each rank starts a warm-up process).
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 330)" python3 -m benchmarks.bench_startup --budget-s 320 \
   --variants default "KILN_TORCH_KEY_MEMO=0" "KILN_KERNEL_WARMUP=0" --warm-repeats 2 --decode-batches 1 8 64 \
   --json $R/startup_warmup_process.json > $L/startup.log 2>&1
grep "kiln ready\|checkpoint:\|exit" $L/startup.log | tail -n 12
cp $R/startup_warmup_process.json $OUT/
CUDA_VISIBLE_DEVICES=0 bounded "$(left 450)" python3 -m pytest -q -p no:cacheprovider -rfE \
   tests/gpu/test_kv_profile_gpu.py tests/gpu/test_compile_cache_gpu.py > $OUT/gpu0_tests.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 450)" python3 -m pytest -q -p no:cacheprovider -rfE \
   tests/gpu/test_cuda_graphs.py > $OUT/gpu1_tests.log 2>&1 &
wait
tail -n 3 $OUT/gpu0_tests.log $OUT/gpu1_tests.log
bounded "$(left 560)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   > $OUT/tp_tests.log 2>&1
tail -n 3 $OUT/tp_tests.log
for f in $R/startup_warmup_process.logs/default-*.log; do grep -v "Warning\|warn\|size/s\]" "$f" | cut -c1-220 > $OUT/$(basename $f); done
echo "total $(( $(date +%s) - T0 )) s"
