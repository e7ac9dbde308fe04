# Issue 27 on one H200 (~5 min): Llama-3-8B start-up from an on-disk checkpoint (cold and warm, by phase, plus
# one sampled warm start), the -O2 exact-size A/B in one process (decode 1/8/64 and offline, with and without),
# and an unguarded script with two compile workers (no traceback, compiles in the workers).
#   bash benchmarks/gpu/startup_exact.sh      (from the repo root; results and logs under $OUT)
source benchmarks/gpu_call.sh
W=/tmp/kiln-startup  # the checkpoint (16 GB, written once) and the start-up caches
C=$W/caches/default
TOTAL=325  # seconds for the whole call; `left N` is what remains of the first N seconds
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }

# 1. start-up: checkpoint, then a cold start (its background compiles waited for, so they reach the cache), a warm
#    start (decode 1/8/64 after it) and a warm start sampled every 5 ms (where its main thread's time goes)
B1=$(min 180 $(( $(left $TOTAL) - 140 )))
bounded "$B1" python -m benchmarks.bench_startup --workdir $W --variants default --decode-batches 1 8 64 \
  --sample-warm --budget-s $((B1 - 10)) --start-timeout-s 120 --json $R/startup.json > $L/startup.log 2>&1
cp $R/startup.logs/*.sample.txt "$OUT"/ 2>/dev/null

# 2. exact sizes or not, one process, the start-up's caches (warm where it filled them), arms A B B A
B2=$(( $(left $TOTAL) - 50 ))
KILN_CACHE_DIR=$C/kiln TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton CUDA_CACHE_PATH=$C/cuda \
  bounded "$B2" python -m benchmarks.bench_exact_sizes --rounds 2 --budget-s $((B2 - 15)) --arm-estimate-s 45 \
  --json $R/exact_sizes.json > $L/exact_sizes.log 2>&1

# 3. a plain script without a __main__ guard, -O2, two compile workers (smollm2-135m, fresh caches)
U=/tmp/kiln-unguarded; rm -rf $U; mkdir -p $U
cat > $U/plain.py <<'PY'
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime("smollm2-135m", load_format="dummy", compile_workers=2, background_compile_sizes=(1,),
             gpu_memory_utilization=0.3)
rt.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
done = rt.finish_background_compiles(timeout=60)
s = rt.compile_stats
json.dump({"worker_compiles": s.worker_compiles, "inductor_compiles": s.inductor_compiles,
           "background_swapped": s.background_swapped, "background_failed": s.background_failed,
           "background_finished": done}, open(sys.argv[1], "w"))
PY
KILN_CACHE_DIR=$U/kiln TORCHINDUCTOR_CACHE_DIR=$U/inductor TRITON_CACHE_DIR=$U/triton \
  bounded $(( $(left $TOTAL) - 5 )) python $U/plain.py $R/unguarded.json > $L/unguarded.log 2>&1

echo "== start-up (llama3-8b, on-disk checkpoint, process start -> first token)"
sed -n '/^20[0-9][0-9]-[0-9][0-9]-[0-9][0-9] |/,$p' $L/startup.log
echo "== where the sampled warm start's main thread went (inclusive s, then self s)"
S=$(ls $R/startup.logs/*warm-sampled*.sample.txt 2>/dev/null | head -1)
[ -n "$S" ] && { sed -n 1,45p "$S" | cut -c1-150; grep -A15 "^self s" "$S" | cut -c1-150; }
echo "== exact sizes A/B (one process)"
sed -n '/^20[0-9][0-9]-[0-9][0-9]-[0-9][0-9] |/,$p' $L/exact_sizes.log
echo "== unguarded script: $(cat $R/unguarded.json 2>/dev/null); tracebacks: $(grep -c Traceback $L/unguarded.log)"
grep -h "background compiles\|failed in its worker\|Inductor compiles in" $L/*.log | cut -c1-200 | head -12
finish_call 6
