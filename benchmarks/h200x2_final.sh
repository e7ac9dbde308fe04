#!/usr/bin/env bash
# 2026-11-30's fourth session on nvidia-h200-x2, about 5 minutes, side by side:
#   GPU 0: Llama-3-8B at default settings: bf16 (kiln::dense_gemm's Triton kernel at small M, the new default),
#          bf16 with cuBLAS only (the A/B), FP8 (Triton FP8 kernel, tuned): decode b1/8/64 and, for each, the
#          offline workload (256 requests, U(100, 1024));
#   GPU 1: the FP8 kernel and FP8 KV GPU tests, then the FP8 KV cache benchmark (bench_gpu kv-dtype);
# (tensor parallelism: benchmarks/h200x2_tp.sh)
set -u
source benchmarks/gpu_call.sh
(
  export CUDA_VISIBLE_DEVICES=0
  bounded "$(left 285)" python3 -m benchmarks.bench_fp8 --defaults --parts decode --bf16-paths triton cublas \
     --fp8-paths triton --batches 1 8 64 --requests 256 --json $R/fp8_defaults.json
) > $L/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded "$(left 140)" python3 -m pytest -q -p no:cacheprovider -rfE tests/models/test_fp8_kernel.py \
     tests/gpu/test_fp8_gpu.py tests/gpu/test_attention_backends.py -k "fp8 or dense_gemm or bf16"
  bounded "$(left 285)" python3 -m benchmarks.bench_gpu kv-dtype --model llama3-8b --configs 64x4096 256x2048 \
     --json $R/kv_dtype.json
) > $L/gpu1.log 2>&1 &
wait
cp $R/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
for f in $L/*.log; do echo "== $f"; grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]" "$f" | tail -n 16; done
echo "total $(( $(date +%s) - T0 )) s"
