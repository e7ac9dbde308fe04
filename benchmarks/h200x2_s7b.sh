#!/usr/bin/env bash
# 2026-11-30's seventh session, second call on nvidia-h200-x2 (~7.5 minutes):
#   GPU 0: start-up from the on-disk 8B checkpoint (issue 14), cold then warm, without the profiler (the fifth
#          session's 47.0 / 15.5 s ran under cProfile): the defaults (the KV-profiling peak remembered, PIECEWISE
#          graphs on the coarser grid) against PIECEWISE graphs at every capture size (the grid's A/B);
#   GPU 1: offline throughput at default settings (issue 16) in four processes: the defaults, a decode range
#          split at 256 tokens (compile_ranges=256), and max_num_batched_tokens 2048 and 16384 (the A/B the
#          8192 default still lacks).
set -u
source benchmarks/gpu_call.sh
ALL_SIZES=1,2,4,8,16,24,32,40,48,56,64,72,80,88,96,104,112,120,128,136,144,152,160,168,176,184,192,200,208,216,224,232,240,248,256,272,288,304,320,336,352,368,384,400,416,432,448,464,480,496,512
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 350)" env -u PYTHONDONTWRITEBYTECODE python3 -m benchmarks.bench_startup \
     --variants default "cudagraph_piecewise_sizes=$ALL_SIZES" --budget-s 335 --json $R/startup.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  common="--defaults --backend triton"
  bounded "$(left 122)" python3 -m benchmarks.bench_gpu throughput $common --repeats 2 --json $R/offline_default.json
  bounded "$(left 240)" python3 -m benchmarks.bench_gpu throughput $common --repeats 2 --compile-ranges 256 \
     --json $R/offline_range256.json
  bounded "$(left 335)" python3 -m benchmarks.bench_gpu throughput $common --max-num-batched-tokens 2048 \
     --json $R/offline_mnbt2048.json
  bounded "$(left 430)" python3 -m benchmarks.bench_gpu throughput $common --max-num-batched-tokens 16384 \
     --json $R/offline_mnbt16384.json
) > $L/gpu1.log 2>&1 &
wait
finish_call 12
