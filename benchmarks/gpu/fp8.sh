#!/usr/bin/env bash
# Llama-3-8B decode on one H200, bf16 against FP8, in one process: batch 1 and 64, every row beside its floor
# (weights + KV at the copy bandwidth measured in the same run). The FP8 runs A/B the split-K reduction: the
# second kernel ("triton", today's default) against the reduction folded into the GEMM kernel ("fold",
# fp8_kernel.FOLD_SPLIT_K). -O2, CUDA graphs at 1..64, async scheduling, random weights, Triton attention.
# Then the folded kernel is checked bit for bit against the reduce kernel at the 8B shapes (if time is left).
# Bounded to 200 s, cold compiles included; the decode JSON is rewritten after every runtime, so a run cut
# short keeps the rows it measured. From the repository root:  OUT=/tmp/out bash benchmarks/gpu/fp8.sh
set -u
source benchmarks/gpu_call.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
bounded "$(left 172)" python3 -m benchmarks.bench_fp8 --parts decode --batches 1 64 --max-num-seqs 64 \
  --steps 48 --fp8-paths triton fold --json "$R/fp8_decode.json" > "$L/fp8_decode.log" 2>&1
echo "rc=$? (124/137: cut at the time bound)"
# the folded reduction against the reduce kernel at the 8B shapes, bit for bit, 20 calls each (all 132 SMs racing
# on the tile counters); skipped when under 20 s are left
cat > /tmp/fold_check.py <<'PY'
import dataclasses, json, sys
import torch
from kiln.models.quant import fp8_kernel as fk
from kiln.models.quant.fp8 import quantize_per_token, quantize_weight
rows = []
for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
    wq, ws = quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    for m in (1, 8, 64):
        xq, xs = quantize_per_token(torch.randn(m, k, device="cuda"))
        cfg = fk.pick_config(m, n, k, fk.num_sms(xq.device))
        cfg = cfg if cfg.split_k > 1 else dataclasses.replace(cfg, split_k=4)
        fk.FOLD_SPLIT_K = False
        ref = fk.fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16, cfg)
        fk.FOLD_SPLIT_K = True
        same = all(torch.equal(fk.fp8_gemm_triton(xq, wq, xs, ws, torch.bfloat16, cfg), ref) for _ in range(20))
        torch.cuda.synchronize()
        rows.append(dict(N=n, K=k, M=m, split_k=cfg.split_k, identical=same,
                         counters_zero=not fk.tile_counters(xq.device).any().item()))
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("fold check:", "all identical" if all(r["identical"] and r["counters_zero"] for r in rows) else "MISMATCH")
PY
bounded "$(left 197)" python3 /tmp/fold_check.py "$R/fold_check.json" > "$L/fold_check.log" 2>&1
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
