#!/usr/bin/env bash
# Structured outputs on one H200 (~150 s with the 8B compile): Llama-3-8B shapes (random weights, a synthetic
# byte-level BPE tokenizer of Llama-3's 128,256 ids), -O2 with CUDA graphs and async scheduling. Prints grammar
# compile and cache-hit times and the decode step with B JSON-schema-constrained requests vs B free ones.
# Needs the wheels xgrammar, apache-tvm-ffi, pydantic, pydantic-core, annotated-types, typing-inspection, gguf
# carried in .whl/.
set -u
source benchmarks/gpu_call.sh
python3 -c "import xgrammar, torch; print('xgrammar', xgrammar.__version__, 'torch', torch.__version__)" 2>&1 | tail -n 1
bounded "$(left 140)" python3 -m benchmarks.bench_structured --model llama3-8b --device cuda --level 2 \
    --tokenizer synthetic --batches 1 16 64 --steps 32 --json $R/structured.json > $L/structured.log 2>&1
finish_call 14
