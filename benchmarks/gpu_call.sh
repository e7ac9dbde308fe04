# Sourced by the scripts that run on a GPU machine (benchmarks/gpu/run.sh and any benchmarks/gpu/*.sh): one call =
# several bounded steps, results under $OUT. Sets the multicast-off variables every multi-GPU program needs,
# installs the wheels carried in .whl/ (packages the device image lacks) into /tmp/site, sets PYTHONPATH,
# $OUT / $R (results) / $L (logs), and helpers: `left N` (seconds until N seconds after the script started),
# `bounded SECONDS CMD...` (CMD in its own process group, the whole group killed after SECONDS, so one hung
# step cannot eat the call) and `finish_call [N]` (below).
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the device image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
# FlashInfer modules built ahead on a machine with nvcc (benchmarks/gpu/flashinfer_aot.sh -> .carry/flashinfer_aot/NAME.so)
# go where FlashInfer looks for prebuilt ones, so the device does not spend minutes in its JIT
for so in .carry/flashinfer_aot/*.so; do
  [ -e "$so" ] && [ -d /tmp/site/flashinfer ] && n=$(basename "$so" .so) && \
    mkdir -p /tmp/site/flashinfer/data/aot/$n && cp "$so" /tmp/site/flashinfer/data/aot/$n/
done
# a file over one call's carry limit travels in parts (.carry/*.part), one call each: they gather in /tmp/parts
mkdir -p /tmp/parts && cp .carry/*.part /tmp/parts/ 2>/dev/null
OUT=${OUT:-/tmp/out}; R=/tmp/res; L=/tmp/logs
# $OUT starts empty in every call: a warm machine's /tmp still holds the previous call's results and logs, which came
# back with it; a second script of the same call finds $OUT written and keeps what the first left (a sweep's table)
[ -z "$(ls -A "$OUT" 2>/dev/null)" ] && rm -rf $R $L
mkdir -p "$OUT" $R $L
left() { echo $(( $1 - ($(date +%s) - T0) )); }
# At its bound a step gets SIGINT first, so a Python one says where it was (a traceback) and pytest prints its summary
# of the failures so far; TERM 8 s later, KILL 2 s after that. A background job starts with SIGINT ignored, which
# exec keeps and Python then honours, so the step is exec'd with the default restored.
bounded() {
  local t=$1; shift
  [ "$t" -lt 20 ] && { echo "skip (no time): $*"; return 124; }
  echo "[$(( $(date +%s) - T0 ))s] start ($t s): $*"
  setsid python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
    "$@" & local pid=$!
  ( sleep "$t"; kill -INT -"$pid" 2>/dev/null; sleep 8; kill -TERM -"$pid" 2>/dev/null; sleep 2
    kill -KILL -"$pid" 2>/dev/null ) & local w=$!
  wait "$pid"; local rc=$?
  kill "$w" 2>/dev/null; kill -KILL -"$pid" 2>/dev/null
  echo "[$(( $(date +%s) - T0 ))s] rc=$rc"
  return $rc
}
# The end of a call: a tarball of results and logs under $OUT, beside it the result JSONs while at most 6 (a call
# brings back 8 files: the rest would be dropped, the tarball among them), and the last N lines of each log
# (progress bars, warnings and JSON bodies left out) in the call's reply.
finish_call() {
  local results=($R/*.json)
  [ -e "${results[0]}" ] && [ ${#results[@]} -le 6 ] && cp "${results[@]}" "$OUT"/
  tar czf "$OUT"/logs.tgz -C /tmp res logs 2>/dev/null
  for f in $L/*.log; do
    echo "== $f"
    grep -v "Warning\|warn\|it/s\]\|graph/s\]\|size/s\]\|File \"/usr\|^|\|^ *\"\|^ *[{}]" "$f" | tail -n "${1:-10}"
  done
  echo "total $(( $(date +%s) - T0 )) s"
}
