#!/usr/bin/env bash
# 2026-11-30's eighth session, third call on nvidia-h200-x2 (~9 minutes), the new defaults (-O2's exact decode
# sizes in the background after the capture; Inductor's combo kernels on a GPU):
#   GPU 0, host otherwise quiet: start-up from the on-disk 8B checkpoint, cold and warm, twice ("level=2" is the
#          default spelled out), decode after the swap (issue 14);
#   then GPU 0: offline throughput at default settings, twice, with the transformers baseline on 64 requests
#          (issue 16); GPU 1: the GPU tests of graphs, async scheduling and the compile cache, then the offline
#          workload again;
#   then both GPUs: the tensor-parallel GPU tests and Llama-3-8B TP=2 at default settings (issue 15's batch 1).
set -u
source benchmarks/gpu_call.sh
CUDA_VISIBLE_DEVICES=0 bounded "$(left 215)" python3 -m benchmarks.bench_startup --variants default level=2 \
   --budget-s 205 --json $R/startup_defaults.json > $L/startup.log 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 470)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 --hf \
     --hf-requests 64 --hf-batch 64 --hf-max-seconds 100 --json $R/offline_defaults.json
) > $L/offline_gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 370)" python3 -m pytest -q -p no:cacheprovider -rfE -s tests/gpu/test_cuda_graphs.py \
     tests/gpu/test_async_scheduling_gpu.py tests/gpu/test_compile_cache_gpu.py
  bounded "$(left 470)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 \
     --json $R/offline_defaults_gpu1.json
) > $L/gpu1.log 2>&1 &
wait
bounded "$(left 530)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   tests/gpu/test_tp_allreduce_gpu.py > $L/tp_tests.log 2>&1
bounded "$(left 590)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 \
   --json $R/profile_8b_tp2.json > $L/tp_8b.log 2>&1
finish_call 12
