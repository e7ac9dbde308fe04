#!/usr/bin/env bash
# 2026-11-30's eighth session, second call on nvidia-h200-x2 (~8 minutes):
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint, cold and warm: the default (exact decode
#          sizes up front, restored after s8a) and the same sizes compiled in the background, now started after
#          the graph capture (issue 14);
#   then both GPUs, the same load on each: offline throughput at default settings vs with Inductor's combo
#          kernels, crossed over the two GPUs in two rounds (issue 16); then bench_passes default vs
#          combo_kernels at decode batch 1/8/64 and prefill 1024, in opposite orders on the two GPUs.
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 200)" python3 -m benchmarks.bench_startup --variants default \
     "compile_sizes=;background_compile_sizes=1,2,4,8" --budget-s 190 --json $R/startup_deferred_bg.json
) > $L/startup.log 2>&1
offline() {  # GPU, arm, round
  local extra=""; [ "$2" = combo ] && extra="--inductor-option combo_kernels=true"
  CUDA_VISIBLE_DEVICES=$1 bounded "$4" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton \
     --repeats 2 $extra --json $R/offline_${2}_r$3.json > $L/offline_${2}_r$3.log 2>&1
}
offline 0 default 1 "$(left 320)" & offline 1 combo 1 "$(left 320)" & wait
offline 0 combo 2 "$(left 440)" & offline 1 default 2 "$(left 440)" & wait
CUDA_VISIBLE_DEVICES=0 bounded "$(left 585)" python3 -m benchmarks.bench_passes --preset llama3-8b --backend triton \
   --configs default combo_kernels --batches 1 8 64 --prefill 1024 --json $R/combo_passes_g0.json \
   > $L/combo_passes_g0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 bounded "$(left 585)" python3 -m benchmarks.bench_passes --preset llama3-8b --backend triton \
   --configs combo_kernels default --batches 1 8 64 --prefill 1024 --json $R/combo_passes_g1.json \
   > $L/combo_passes_g1.log 2>&1 &
wait
finish_call 12
