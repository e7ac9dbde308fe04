#!/usr/bin/env bash
# 2026-11-30's fifth session, second call on nvidia-h200-x2 (~9.5 minutes):
#   GPU 0: the offline workload at default settings with the transformers baseline in the same run (issue 16);
#   GPU 1: the compiled FP8 test (emulate_precision_casts for quantized models only), then, once GPU 0's compile
#          is over (the two would share the host's cores), start-up cold/warm with a cProfile of each start;
#   both:  the TP=2 -O2 GPU test alone, every rank printing its stacks every 40 s (it never finished in 250 s),
#          then with NCCL all-reduces instead of the P2P ones; then Llama-3-70B TP=2 at batch 1 and 64.
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 270)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --hf --hf-requests 64 \
     --hf-batch 64 --hf-max-seconds 90 --json $R/offline_defaults.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 75)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8_gpu.py -k compiled_graphed
  sleep "$(left 80)"
  bounded "$(left 270)" env -u PYTHONDONTWRITEBYTECODE KILN_BENCH_PROFILE=1 python3 -m benchmarks.bench_startup \
     --variants default --budget-s 185 --json $R/startup.json
) > $L/gpu1.log 2>&1 &
wait
export KILN_DUMP_STACKS_AFTER=40
bounded "$(left 370)" python3 -m pytest -q -s -p no:cacheprovider -rfE -o faulthandler_timeout=90 \
   tests/gpu/test_tensor_parallel_gpu.py -k "O2-default-graphs and not async" > $L/tp_o2.log 2>&1
bounded "$(left 440)" env KILN_TP_ALLREDUCE=nccl python3 -m pytest -q -s -p no:cacheprovider -rfE \
   -o faulthandler_timeout=60 tests/gpu/test_tensor_parallel_gpu.py -k "O2-default-graphs and not async" \
   > $L/tp_o2_nccl.log 2>&1
unset KILN_DUMP_STACKS_AFTER
bounded "$(left 590)" python3 -m benchmarks.bench_profile --configs llama3-70b:2:bf16 --batches 1 64 \
   --json $R/profile_70b.json > $L/tp_70b.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
cp -r $R/startup.logs "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr" "$f" | tail -n 12; done
echo "total $(( $(date +%s) - T0 )) s"
