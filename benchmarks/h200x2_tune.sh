#!/usr/bin/env bash
# One call on nvidia-h200-x2 (2026-11-30, second session), about 4 minutes:
# GPU 0: the Triton decode-attention launch sweep (bench_attention --sweep), then the PIECEWISE-above-256
#        A/B (bench_capture_plan);
# GPU 1: start-up re-timed with Python allowed to write bytecode (the image sets no .pyc cache otherwise?
#        printed first), cold then warm.
set -u
source benchmarks/gpu_call.sh
env | grep -i '^python' ; python3 -c "import sys, sysconfig, os; p=sysconfig.get_paths()['purelib']; print('dont_write_bytecode', sys.dont_write_bytecode, p, 'writable', os.access(p, os.W_OK))"
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 200)" python3 -m benchmarks.bench_attention --sweep --batches 1 64 256 --contexts 160 600 2048 \
     --json $R/attention_sweep.json
  bounded "$(left 330)" python3 -m benchmarks.bench_capture_plan --json $R/capture_plan.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  env -u PYTHONDONTWRITEBYTECODE bash -c 'python3 -c "import sys; print(\"bytecode writes on:\", not sys.dont_write_bytecode)"'
  env -u PYTHONDONTWRITEBYTECODE timeout 320 python3 -m benchmarks.bench_startup --variants default --budget-s 300 \
     --start-timeout-s 150 --json $R/startup.json
) > $L/gpu1.log 2>&1 &
wait
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
tail -n 30 $L/*.log
echo "total $(( $(date +%s) - T0 )) s"
