#!/usr/bin/env bash
# The H200 measurements still owed after 2026-11-30 (docs/BENCHMARKS.md), in one call on nvidia-h200-x2:
# GPU 0 re-times start-up (config read without transformers, tokenizer thread), GPU 1 runs the online serving
# benchmark (its 2026-11-30 run died on the --device auto bug); then, on both GPUs, TP=2 == TP=1 with default
# CUDA graphs and shutdown (tests/gpu) and TP=1 vs TP=2 at default settings. Each step runs in its own process
# group under a time bound; results go to $OUT (JSON) and $OUT/logs.tgz.
#   usage, from the repo root on the device: bash benchmarks/h200x2_pending.sh   (about 9.5 minutes)
# Packages the device image lacks (fastapi, uvicorn, pydantic, openai, ...) are installed from ./.whl when present.
set -u
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; R=/tmp/res; L=/tmp/logs; mkdir -p "$OUT" $R $L
left() { echo $(( $1 - ($(date +%s) - T0) )); }
bounded() {  # bounded SECONDS CMD...: run CMD in its own process group, kill the group after SECONDS
  local t=$1; shift
  [ "$t" -lt 20 ] && { echo "skip (no time): $*"; return 124; }
  echo "[$(( $(date +%s) - T0 ))s] start ($t s): $*"
  setsid "$@" & local pid=$!
  ( sleep "$t"; kill -TERM -"$pid" 2>/dev/null; sleep 5; kill -KILL -"$pid" 2>/dev/null ) & local w=$!
  wait "$pid"; local rc=$?
  kill "$w" 2>/dev/null; kill -KILL -"$pid" 2>/dev/null
  echo "[$(( $(date +%s) - T0 ))s] rc=$rc"
  return $rc
}
nvidia-smi --query-gpu=name,memory.used --format=csv
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 240)" python3 -m benchmarks.bench_startup --variants default --budget-s 220 \
     --start-timeout-s 150 --json $R/startup.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 240)" python3 -m benchmarks.bench_serve --model llama3-8b --ready-timeout 150 \
     --num-prompts 16 48 128 192 --json $R/serve.json
) > $L/gpu1.log 2>&1 &
wait
bounded "$(left 400)" python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
   > $L/tp_test.log 2>&1
bounded "$(left 560)" python3 -m benchmarks.bench_tp_serving --configs llama3-8b:1 llama3-8b:2 --batches 1 8 64 \
   --json $R/tp_serving.json > $L/tp_serving.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
tail -n 3 $L/*.log
echo "total $(( $(date +%s) - T0 )) s"
