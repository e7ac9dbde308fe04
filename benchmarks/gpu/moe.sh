#!/usr/bin/env bash
# Mixture-of-experts on one H200 (~570 s): (1) the fused MoE op's Triton kernels vs the torch reference and a
# tiny MoE model's greedy tokens with CUDA graphs == without (tests/gpu/test_moe_gpu.py); (2) a tuning sweep of the
# kernels' launch configs at Qwen3-30B-A3B's layer shape (benchmarks/tune_fused_moe.py -> $OUT/fused_moe_h200.json,
# the table kiln/models/fused_moe/configs/h200.json ships), which the benchmark below then uses; (3)
# benchmarks/bench_moe.py: the Qwen3-30B-A3B preset (random bf16 weights drawn on the GPU), default settings,
# decode at batch 1/8/64 and the offline run beside floors from this run's copy bandwidth, and one layer's torch
# loop over experts vs the fused op. Each step is bounded and writes JSON; a failing step does not stop the next.
set -u
source benchmarks/gpu_call.sh
bounded 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py \
  tests/runtime/test_kernel_warmup.py::test_moe_shapes_are_the_distinct_expert_layers > $L/moe_tests.log 2>&1
tail -n 4 $L/moe_tests.log
cp kiln/models/fused_moe/configs/h200.json $R/fused_moe_h200.json 2>/dev/null
bounded 75 python3 -m benchmarks.tune_fused_moe --budget-s 50 --out $R/fused_moe_h200.json > $L/tune.log 2>&1
tail -n 18 $L/tune.log
[ -s $R/fused_moe_h200.json ] && export KILN_FUSED_MOE_CONFIGS=$R/fused_moe_h200.json
bounded "$(left 405)" python3 -m benchmarks.bench_moe --json $R/bench_moe.json > $L/bench_moe.log 2>&1
grep -v "Warning\|warn" $L/bench_moe.log | tail -n 30
# with time to spare: the TP=2 shard of the same layer (intermediate 384 per rank) into the same table
T2=$(( $(left 415) - 10 ))
bounded "$T2" python3 -m benchmarks.tune_fused_moe --shape 128,384,2048,8 --budget-s $(( T2 - 20 )) \
  --out $R/fused_moe_h200.json > $L/tune_tp2.log 2>&1 && tail -n 15 $L/tune_tp2.log
finish_call 8
