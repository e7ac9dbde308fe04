#!/usr/bin/env bash
# Issue 15, rank 0's host under TP=2 (one call on nvidia-h200-x2, at most ~9.5 minutes, expected ~7):
# 1. bench_step_channel: gloo vs shared-memory step channel, send and round trip, batch 1 and 256, on this
#    host's CPUs (no GPU; ~30 s);
# 2. bench_logits_gather: the vocab-parallel logits gather, functional collective vs kiln's eager c10d path,
#    host and total us at rows 1/64/256 on the two GPUs (~1 min);
# 3. bench_profile llama3-8b TP=2 at batch 1 and 64 (rank 0's GPU busy/idle per step), first with
#    KILN_TP_STEP_CHANNEL=gloo (the old channel, and the cold compile), then with the default (shm, warm).
# JSON and logs come back in $OUT.
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
bounded "$(left 60)" python3 -m benchmarks.bench_step_channel --steps 3000 --out $R/step_channel.json \
  > $L/step_channel.log 2>&1
bounded "$(left 150)" python3 -m benchmarks.bench_logits_gather --device cuda --rows 1 64 256 \
  --out $R/logits_gather.json > $L/logits_gather.log 2>&1
KILN_TP_STEP_CHANNEL=gloo bounded "$(left 360)" python3 -m benchmarks.bench_profile \
  --configs llama3-8b:2:bf16 --batches 1 64 --json $R/profile_tp2_gloo.json > $L/tp_gloo.log 2>&1
bounded "$(left 560)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 \
  --json $R/profile_tp2_shm.json > $L/tp_shm.log 2>&1
ls /dev/shm | grep kiln-tp && echo "LEAKED shm segments above" || echo "no kiln-tp shm segment left"
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn" "$f" | tail -n 14; done
echo "total $(( $(date +%s) - T0 )) s"
