#!/usr/bin/env bash
# 2026-11-30's sixth session, a call on nvidia-h200 (one GPU, ~4 minutes): the offline workload at default
# settings (issue 16), twice on one runtime with fresh prompt tokens each time, and the transformers baseline
# on the first 64 requests (kiln on fresh prompts of the same lengths: no prefix-cache hits).
set -u
source benchmarks/gpu_call.sh
bounded "$(left 400)" python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 --hf \
   --hf-requests 64 --hf-batch 64 --hf-max-seconds 90 --json $R/offline_defaults.json > $L/offline.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr\|^|" "$f" | tail -n 12; done
echo "total $(( $(date +%s) - T0 )) s"
