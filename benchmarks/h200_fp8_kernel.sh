#!/usr/bin/env bash
# Issue 17, kiln's Triton FP8 GEMM, in one call on nvidia-h200 (one GPU), about 9 minutes at most:
#   1. correctness: the kernel against float64 / _scaled_mm (every swept tile), dispatch on M, greedy tokens
#      Triton vs _scaled_mm on a compiled, CUDA-graphed FP8 model (tests/models/test_fp8_kernel.py,
#      tests/gpu/test_fp8_gpu.py);
#   2. the kernel sweep (bench_fp8 --parts kernels): per projection and M = 1..64, bf16 / _scaled_mm / the
#      heuristic / every swept config vs the weight-bytes floor; prints a suggested fp8_kernel.TUNED;
#   3. llama3-8b decode (-O2, graphs) at batch 1 / 8 / 64 with FP8 on the Triton path and on _scaled_mm only
#      (bf16 was measured on 2026-11-30: 4.91 / 5.07 / 5.72 ms, docs/BENCHMARKS.md).
# Each step runs in its own process group under a time bound; JSON and logs go to $OUT.
#   usage, from the repo root on the device: bash benchmarks/h200_fp8_kernel.sh
set -u
T0=$(date +%s)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
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
bounded "$(left 180)" python3 -m pytest -q -p no:cacheprovider -rfE tests/models/test_fp8_kernel.py \
  tests/gpu/test_fp8_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -40
bounded "$(left 360)" python3 -m benchmarks.bench_fp8 --parts kernels --kernel-budget-s 120 \
  --json "$OUT/fp8_kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -v "rows$"
bounded "$(left 585)" python3 -m benchmarks.bench_fp8 --parts decode --no-bf16 --fp8-paths triton cublas \
  --batches 1 8 64 --max-num-seqs 64 --requests 0 --json "$OUT/fp8_decode.json" 2>&1 | tee "$OUT/decode.log" | tail -30
echo "total $(( $(date +%s) - T0 ))s"
