#!/usr/bin/env bash
# Speculative decoding on one H200 (<= 240 s): the verify step's cost (Llama-3-8B shape, random weights, batch 1,
# k=4) and, when the embedded model's GGUF was carried in two parts (.carry/smollm2-{a,b}.part, from
# `split -n 2` of SmolLM2-135M-Instruct.Q4_1.gguf), tokens/s with and without n-gram proposals on the copy,
# edit and free-form tasks. Needs the wheels gguf and accelerate in .whl/ (the GGUF conversion).
#   bash benchmarks/gpu/spec_decode.sh        (from the repository root; results under $OUT)
source benchmarks/gpu_call.sh
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export KILN_CACHE_DIR=/tmp/kiln-cache

# 1. the 8B verify ratio first: it needs nothing carried
bounded $(left 125) python3 -m benchmarks.bench_spec_decode --device cuda \
  --skip-tasks --verify-ratio --capture-sizes 1 2 4 8 16 --background-timeout 40 --json $R/spec_verify_ratio.json > $L/verify_ratio.log 2>&1

# 2. the real embedded model, if its parts came along
if ls .carry/smollm2-*.part >/dev/null 2>&1; then
  mkdir -p /tmp/smollm2
  cat .carry/smollm2-*.part > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if echo "$GGUF_SHA256  /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet; then
    export KILN_EMBEDDED_GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    bounded $(( $(left 230) )) python3 -m benchmarks.bench_spec_decode --device cuda --max-tokens 128 --capture-sizes 1 2 4 8 16 --background-timeout 30 \
      --repeats 3 --json $R/spec_tasks.json > $L/spec_tasks.log 2>&1
    # 3. if time is left: the model drafting for itself (the copy task only; skipped under 20 s)
    bounded $(( $(left 236) )) python3 -m benchmarks.bench_spec_decode --device cuda --max-tokens 128 \
      --capture-sizes 1 2 4 8 16 --background-timeout 20 --draft-model self --tasks copy free --repeats 2 \
      --json $R/spec_tasks_draft.json > $L/spec_tasks_draft.log 2>&1
  else
    echo "the joined GGUF's sha256 is not $GGUF_SHA256: real-model part skipped" | tee $L/spec_tasks.log
  fi
else
  echo "no .carry/smollm2-*.part: real-model part skipped" | tee $L/spec_tasks.log
fi
finish_call 14
