#!/usr/bin/env bash
# 2026-11-30's fourth session on nvidia-h200-x2, about 9 minutes, both GPUs: TP=2 == TP=1 with CUDA graphs and
# the shared-memory step channel (tests/gpu/test_tensor_parallel_gpu.py), then the TP=2 decode profile at
# default settings (rank 0's busy/idle per step), Llama-3-8B then Llama-3-70B, batch 1 and 64.
set -u
source benchmarks/gpu_call.sh
bounded "$(left 250)" python3 -m pytest -x -q -p no:cacheprovider -rfE --durations=5 \
   tests/gpu/test_tensor_parallel_gpu.py > $L/tp_test.log 2>&1
bounded "$(left 530)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 llama3-70b:2:bf16 \
   --batches 1 64 --json $R/profile_tp2.json > $L/tp_profile.log 2>&1
ls /dev/shm | grep kiln-tp && echo "LEAKED shm segments above" || echo "no kiln-tp shm segment left"
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]" "$f" | tail -n 22; done
echo "total $(( $(date +%s) - T0 )) s"
