#!/usr/bin/env bash
# 2026-11-30's sixth session, last call on nvidia-h200-x2 (~7 minutes):
#   both GPUs: the P2P all-reduce GPU tests (the fused all-reduce + add + RMSNorm kernel now alternates
#              between two buffer halves and has one barrier), then the 70B TP=2 profile at default settings;
#   GPU 0:     the offline workload at default settings (issue 16), twice on one runtime with fresh prompt
#              tokens each time, and the transformers baseline on the first 64 requests (kiln on fresh prompts
#              of the same lengths: no prefix-cache hits, unlike the earlier sessions' subset runs).
set -u
source benchmarks/gpu_call.sh
bounded "$(left 100)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tp_allreduce_gpu.py \
   > $L/allreduce_tests.log 2>&1
bounded "$(left 215)" python3 -m benchmarks.bench_profile --configs llama3-70b:2:bf16 --batches 1 64 \
   --json $R/profile_70b_tp2_defaults.json > $L/tp_profile_70b.log 2>&1
export CUDA_VISIBLE_DEVICES=0
bounded "$(left 420)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 --hf \
   --hf-requests 64 --hf-batch 64 --hf-max-seconds 90 --json $R/offline_defaults.json > $L/offline.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr\|^|\|^ *\"\|^ *[{}]" "$f" | tail -n 14; done
echo "total $(( $(date +%s) - T0 )) s"
