#!/usr/bin/env bash
# Llama-3-8B decode on one H200, bf16 against FP8, in one process: batch 1 and 64, every row beside its floor
# (weights + KV at the copy bandwidth measured in the same run). The FP8 runs A/B the split-K reduction: the
# second kernel ("triton", today's default) against the reduction folded into the GEMM kernel ("fold",
# fp8_kernel.FOLD_SPLIT_K). -O2, CUDA graphs at 1..64, async scheduling, random weights, Triton attention.
# Bounded to 195 s, cold compiles included; the decode JSON is rewritten after every runtime, so a run cut
# short keeps the rows it measured. From the repository root:  OUT=/tmp/out bash benchmarks/gpu/fp8.sh
set -u
source benchmarks/gpu_call.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
bounded "$(left 190)" python3 -m benchmarks.bench_fp8 --parts decode --batches 1 64 --max-num-seqs 64 \
  --steps 48 --fp8-paths triton fold --json "$R/fp8_decode.json" > "$L/fp8_decode.log" 2>&1
echo "rc=$? (124/137: cut at the time bound)"
finish_call 16
echo
grep "^|" "$L/fp8_decode.log" || python3 - "$R/fp8_decode.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1])).get("decode", [])
except (OSError, ValueError):
    rows = []
print("| weights | batch | step ms | tok/s | floor ms | x floor |")
for r in rows:
    print(f"| {r['weights']} | {r['batch']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} |")
PY
