#!/usr/bin/env bash
# 2026-12-01's session, its one call on nvidia-h200 (the turn's last ~4 minutes of device time): not a measurement,
# a check that the three start-up changes made on the CPU run on the GPU machine's torch 2.11 / transformers 5.17:
# Inductor's write_atomic replaced (kiln/cache/inductor_writes.py), the tokenizer pickled (runtime/tokenizer_cache.py)
# and triton_key's rebind. A tiny-llama cold and warm start from an on-disk checkpoint with a tokenizer (-O1, so
# few compiles); then which files of the compile and tokenizer caches the warm start wrote (it should write none).
set -u
source benchmarks/gpu_call.sh
bounded 45 python3 -m pytest -q -p no:cacheprovider tests/cache/test_inductor_writes.py tests/cache/test_triton_key.py \
  > $L/tests.log 2>&1
tail -n 3 $L/tests.log
bounded "$(left 150)" python3 -m benchmarks.bench_startup --preset tiny-llama --variants "level=1" --decode-batches 1 \
  --budget-s 140 --workdir /tmp/ks --json $R/s11a_tiny_startup.json > $L/startup.log 2>&1
grep "kiln ready\|Error\|error" $L/startup.log | tail -n 6
python3 - 2>&1 <<'PY'
import json, pathlib
report = json.loads(pathlib.Path("/tmp/res/s11a_tiny_startup.json").read_text())
for variant, starts in report["variants"].items():
    for start, r in starts.items():
        print(variant, start, {k: r.get(k) for k in ("to_first_token_s", "summary", "cache_hits", "inductor_compiles",
                                                     "error")})
root = next(pathlib.Path("/tmp/ks/caches").glob("*/kiln"))
files = [p for p in root.rglob("*") if p.is_file() and ("inductor" in p.parts or "tokenizers" in p.parts)]
cold_end = next(pathlib.Path("/tmp/res/s11a_tiny_startup.logs").glob("*-cold.result.json")).stat().st_mtime
late = [p for p in files if p.stat().st_mtime > cold_end]
print(f"{len(files)} inductor/tokenizer cache files; written after the cold start ended (by the warm one): {len(late)}")
for p in sorted(late)[:10]:
    print("  ", p.relative_to(root))
print("tokenizer pickles:", [p.name for p in root.glob("tokenizers/*.pkl")])
PY
finish_call 12
