#!/usr/bin/env bash
# 2026-11-30's sixth session, second call on nvidia-h200-x2 (~9.5 minutes), both GPUs throughout:
#   the P2P all-reduce GPU tests (now with the one-kernel all-reduce + add + RMSNorm, kiln/models/p2p_norm.py);
#   bench_tp's decode A/B, pass allreduce_rmsnorm off vs on, 8B and 70B at TP=2 (issue 15 scope 3);
#   bench_profile 8B / 70B TP=2 at batch 1 / 64 at default settings (which now include the pass);
#   the tensor-parallel GPU tests, if time is left.
set -u
source benchmarks/gpu_call.sh
bounded "$(left 150)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tp_allreduce_gpu.py \
   > $L/allreduce_tests.log 2>&1
bounded "$(left 390)" python3 -m benchmarks.bench_tp --skip-allreduce --budget-s 225 \
   --configs 70b-auto-off 70b-auto-pass 8b-auto-off 8b-auto-pass --json $R/tp_pass_ab.json > $L/tp_ab.log 2>&1
# one process per TP runtime: a second one in the same process would fall back to NCCL (docs/distributed.md)
bounded "$(left 460)" python3 -m benchmarks.bench_profile --configs llama3-70b:2:bf16 --batches 1 64 \
   --json $R/profile_70b_tp2_defaults.json > $L/tp_profile_70b.log 2>&1
bounded "$(left 520)" python3 -m benchmarks.bench_profile --configs llama3-8b:2:bf16 --batches 1 64 \
   --json $R/profile_8b_tp2_defaults.json > $L/tp_profile_8b.log 2>&1
bounded "$(left 595)" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_tensor_parallel_gpu.py \
   > $L/tp_tests.log 2>&1
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr" "$f" | tail -n 16; done
echo "total $(( $(date +%s) - T0 )) s"
