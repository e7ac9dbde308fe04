#!/usr/bin/env bash
# Runs named benchmark sets on a GPU machine, one after another, each step bounded in time. Every step's JSON
# lands in $OUT, the logs in $OUT/logs.tgz, and a table of the steps (exit code, seconds, JSON) ends the output.
# From the repository root:
#
#   OUT=/tmp/out bash benchmarks/gpu/run.sh [--budget SECONDS] SET...    e.g. ... run.sh decode offline
#   bash benchmarks/gpu/run.sh --list                                     the sets and their commands
#
# --budget (default 570): the whole call's wall-clock bound, compiles included; a step gets the smaller of its
# own bound and what is left, and one with under 20 s left is skipped (rc 124). Sets run in the order given on
# the GPUs the caller makes visible; `tp` needs two. These are the commands docs/BENCHMARKS.md cites. The
# sourced gpu_call.sh sets the multicast-off variables and installs the wheels carried in .whl/.
set -u
export_vars() {  # an arm's NAME=VALUE[,NAME=VALUE] exported (an arm without "=", e.g. "new" or "default": nothing)
  local vars
  case $1 in *=*) IFS=, read -ra vars <<< "$1"; export "${vars[@]}";; esac
}
set_decode() {  # Llama-3-8B and SmolLM2-135M decode at default settings, floors and transformers beside, then the
  # gpt-fast-style anchor (a plain Llama-3-8B compiled whole) at batch 1 and 8
  step decode 360 python3 -m benchmarks.bench_gpu decode --defaults --backend triton --models llama3-8b smollm2-135m \
    --async-scheduling on --hf --json "$R/decode.json"
  set_anchor
}
set_decode_table() {  # docs/BENCHMARKS.md's Decode table at default settings in one call, a process per row: SmolLM2-135M
  # and Llama-3-8B bf16, Llama-3-8B FP8, each at batch 1 / 8 / 64, then Qwen3-30B-A3B (the MoE table's decode rows)
  local models row
  for row in "smollm2-135m:" "llama3-8b:" "llama3-8b:--quantization fp8"; do
    models=${row%%:*}; local extra=${row#*:}; local tag=${models//[^A-Za-z0-9_]/_}${extra:+_fp8}
    step "decode_table_$tag" 200 python3 -m benchmarks.bench_gpu decode --defaults --backend triton --models "$models" \
      --async-scheduling on --batches 1 8 64 $extra --json "$R/decode_table_$tag.json"
  done
  step decode_table_qwen3_30b_a3b 240 python3 -m benchmarks.bench_moe --parts decode --json "$R/decode_table_qwen3_30b_a3b.json"
}
set_anchor() {  # the gpt-fast-style anchor alone
  step anchor 200 python3 -m benchmarks.bench_anchor --preset llama3-8b --batches 1 8 --json "$R/anchor.json"
}
set_offline() {  # 256 requests, lengths U(100, 1024), default settings; transformers on the first 64
  step offline 420 python3 -m benchmarks.bench_gpu throughput --defaults --backend triton --repeats 2 --hf \
    --hf-requests 64 --hf-batch 64 --hf-max-seconds 90 --json "$R/offline.json"
}
set_serve() {  # kiln serve at default settings under kiln bench serve, four request rates
  step serve 420 python3 -m benchmarks.bench_serve --model llama3-8b --ready-timeout 200 \
    --num-prompts 16 48 128 192 --json "$R/serve.json"
}
set_startup() {  # the on-disk 8B checkpoint: a cold and a warm start by phase, decode in the warm process
  step startup 340 python3 -m benchmarks.bench_startup --variants default --budget-s 330 --json "$R/startup.json"
}
set_startup_sampled() {  # a cold and a warm start, then one more warm start with its main thread sampled every 5 ms
  # (the report: <logs>/default-warm-sampled.result.sample.txt in logs.tgz)
  step startup_sampled 300 python3 -m benchmarks.bench_startup --variants default --sample-warm --decode-batches 1 \
    --budget-s 290 --json "$R/startup_sampled.json"
}
set_startup_ab() {  # start-up arms (STARTUP_AB_VARIANTS, default the ones docs/startup.md left open: pre-import off /
  # default / weights in line), STARTUP_AB_WARM_REPEATS warm starts each (default 5)
  step startup_ab 570 python3 -m benchmarks.bench_startup \
    --variants ${STARTUP_AB_VARIANTS:-KILN_COMPILER_PREIMPORT=0 default KILN_WEIGHT_STREAM=0} \
    --warm-repeats "${STARTUP_AB_WARM_REPEATS:-5}" --decode-batches 1 --budget-s 560 --json "$R/startup_ab.json"
}
set_fp8() {  # FP8 weights against bf16 at default settings: decode and offline (FP8_PARTS: one of them)
  step fp8 420 python3 -m benchmarks.bench_fp8 --defaults --parts ${FP8_PARTS:-decode throughput} --json "$R/fp8.json"
}
set_profile() {  # a decode step's kernels by kind, bf16 and FP8, batch 1 and 64 (PROFILE_CONFIGS, PROFILE_BATCHES); a
  # process per config: in one process the configs after the first got a KV budget of 0 bytes (2026-12-03).
  # PROFILE_ARMS: "default" and/or NAME=VALUE[,NAME=VALUE] (those environment variables), one process each;
  # PROFILE_ARGS: more bench_profile arguments (e.g. --host: a cProfile of the host's steps)
  local config arm tag
  for arm in ${PROFILE_ARMS:-default}; do
    for config in ${PROFILE_CONFIGS:-llama3-8b:1:bf16 llama3-8b:1:fp8}; do
      tag=profile_${config//[^A-Za-z0-9_]/_}; [ "$arm" = default ] || tag=${tag}_${arm//[^A-Za-z0-9_]/_}
      (
        export_vars "$arm"
        step "$tag" 200 python3 -m benchmarks.bench_profile --configs "$config" \
          --batches ${PROFILE_BATCHES:-1 64} ${PROFILE_ARGS:-} --json "$R/$tag.json"
      )
    done
  done
}
set_passes() {  # compiler passes off vs on, decode and the prefill of a 1024-token prompt, one process per preset
  # (PASSES_CONFIGS: bench_passes configurations, passes joined by "+", "<=16": decode sizes only; PASSES_PRESETS)
  local preset
  for preset in ${PASSES_PRESETS:-smollm2-135m llama3-8b}; do
    step "passes_$preset" 240 python3 -m benchmarks.bench_passes --preset "$preset" \
      --configs ${PASSES_CONFIGS:-off default} --batches 1 8 64 --prefill 1024 \
      --json "$R/passes_${preset//[^A-Za-z0-9_]/_}.json"
  done
}
set_attention() {  # attention kernels per backend (FlashInfer when installed): decode, prefill, mixed steps
  step attention 300 python3 -m benchmarks.bench_attention --backends triton flashinfer --batches 1 8 64 256 \
    --contexts 512 4096 --json "$R/attention.json"
}
set_attention_sweep() {  # the Triton decode's launch knobs swept (ATTN_SWEEP_VARY, default waves merge_chunks; KNOB=V,V
  # for given values) per head shape (ATTN_SWEEP_HEADS, "HQ,HKV,HEAD_DIM[,BATCH:BATCH]" ..., default Llama-3-8B's,
  # Qwen3-30B-A3B's, SmolLM2-135M's; the batches default to ATTN_SWEEP_BATCHES, 1 8), contexts ATTN_SWEEP_CONTEXTS
  # (160 1024 4096), each shape's step bounded by ATTN_SWEEP_S (150)
  local shape hq hkv d batches
  for shape in ${ATTN_SWEEP_HEADS:-32,8,128 32,4,128 9,3,64}; do
    IFS=, read -r hq hkv d batches <<< "$shape"
    batches=${batches//:/ }
    step "attn_sweep_${hq}_${hkv}_$d" "${ATTN_SWEEP_S:-150}" python3 -m benchmarks.bench_attention --backends triton \
      --sweep --vary ${ATTN_SWEEP_VARY:-waves merge_chunks} --heads "$hq" "$hkv" --head-dim "$d" \
      --batches ${batches:-${ATTN_SWEEP_BATCHES:-1 8}} \
      --contexts ${ATTN_SWEEP_CONTEXTS:-160 1024 4096} --json "$R/attn_sweep_${hq}_${hkv}_$d.json"
  done
}
set_backend_ab() {  # decode at default settings with each attention backend (FlashInfer when installed)
  for backend in triton flashinfer; do
    step "decode_$backend" 240 python3 -m benchmarks.bench_gpu decode --defaults --backend "$backend" \
      --models llama3-8b smollm2-135m --async-scheduling on --json "$R/decode_$backend.json"
  done
}
set_gemm() {  # the projection GEMMs at decode M: cuBLAS, kiln's Triton bf16 and FP8 kernels, _scaled_mm (GEMM_PRESETS: the
  # models, default Llama-3-8B; GEMM_M: the token counts, default bench_gemm's 1 to 64; GEMM_PROJECTIONS: some of
  # qkv o gate_up down, e.g. "qkv o" for a mixture of experts; GEMM_TP=2: one rank's shards too; GEMM_ARGS: more
  # bench_gemm arguments, e.g. "--promote 32 128 --no-bf16-sweep"; GEMM_S: a preset's bound, default
  # 240 s, no new projection started past 40 s before it; GEMM_TAG: a suffix of the files, for a second sweep in the
  # same call). The winners are added to $R/gemm_table$GEMM_TAG.json, a KILN_GEMM_CONFIGS table for a decode-ab arm
  local preset bound=${GEMM_S:-240} tag=${GEMM_TAG:-}
  for preset in ${GEMM_PRESETS:-llama3-8b}; do
    step "gemm_$preset$tag" "$bound" python3 -m benchmarks.bench_gemm --part small-m --preset "$preset" \
      ${GEMM_M:+--m $GEMM_M} ${GEMM_PROJECTIONS:+--projections $GEMM_PROJECTIONS} ${GEMM_TP:+--tp $GEMM_TP} \
      ${GEMM_ARGS:-} --budget-s $(( bound - 40 )) --table-out "$R/gemm_table$tag.json" \
      --json "$R/gemm_${preset//[^A-Za-z0-9_]/_}$tag.json"
  done
}
set_silu_quant() {  # silu_mul_quant's kernels alone: Inductor's for the unfused graph against kiln's, 1 to 4096 rows of
  # Llama-3-8B's 14336
  step silu_quant 150 python3 -m benchmarks.bench_passes --silu-quant-kernels 14336 --json "$R/silu_quant.json"
}
set_argmax() {  # the greedy argmax: ATen's against kiln's split-row kernel per row count and vocabulary
  step argmax 120 python3 -m benchmarks.bench_argmax --json "$R/argmax.json"
}
set_persistent() {  # SmolLM2-135M's projection chain at one token: a kernel per projection (PDL) against one persistent
  # kernel with grid barriers, and kiln's GEMMs; then the persistent kernel at half the programs and at 8 warps
  step persistent 120 python3 -m benchmarks.bench_persistent --json "$R/persistent.json"
  step persistent_half 90 python3 -m benchmarks.bench_persistent --programs 66 --json "$R/persistent_half.json"
  step persistent_w8 90 python3 -m benchmarks.bench_persistent --warps 8 --json "$R/persistent_w8.json"
}
set_gemm_moe() {  # Qwen3-30B-A3B's attention projections at decode M: cuBLAS and kiln's small-M kernel, every tile config
  step gemm_moe 200 python3 -m benchmarks.bench_gemm --part small-m --preset qwen3-30b-a3b --projections qkv o \
    --m 1 8 --json "$R/gemm_moe.json"
}
set_gemv_stream() {  # one token's e4m3 projections: the MMA kernel against the streaming matrix-vector kernel's rule and
  # swept configs (GEMV_STREAM_PRESETS, default Llama-3-8B's four; PRESET:qkv,o for some of a model's projections)
  local spec preset
  for spec in ${GEMV_STREAM_PRESETS:-llama3-8b}; do
    preset=${spec%%:*}; local projections=""; [ "$spec" != "$preset" ] && projections=${spec#*:}
    step "gemv_stream_$preset" 150 python3 -m benchmarks.bench_gemm --part gemv-stream --preset "$preset" \
      ${projections:+--projections ${projections//,/ }} --json "$R/gemv_stream_${preset//[^A-Za-z0-9_]/_}.json"
  done
}
set_gemm_host() {  # the host's time per projection GEMM call, eager and under capture, new and seen shapes
  step gemm_host 120 python3 -m benchmarks.bench_gemm --part host --json "$R/gemm_host.json"
}
set_smollm2_kernels() {  # SmolLM2-135M's decode kernels at batch 1 / 8: its four projections' GEMM tiles (kiln's rule
  # against every swept tile) and the Triton decode attention's launch configurations at its 9 / 3 heads of 64
  step smollm2_gemm 200 python3 -m benchmarks.bench_gemm --part small-m --preset smollm2-135m --m 1 8 \
    --json "$R/smollm2_gemm.json"
  step smollm2_attention 300 python3 -m benchmarks.bench_attention --backends triton --sweep --heads 9 3 \
    --head-dim 64 --batches 1 8 --contexts 128 1024 --json "$R/smollm2_attention.json"
}
set_tp() {  # two GPUs: all-reduce kernels, then 8B TP=1/TP=2 and 70B TP=2 decode, sync and async
  set_tp_allreduce
  set_tp_decode
}
set_tp_allreduce() {  # two GPUs: the all-reduce kinds per message size, the all-reduce + add + norm per decode shape
  step tp_allreduce 150 python3 -m benchmarks.bench_tp --parts allreduce --json "$R/tp_allreduce.json"
}
set_tp_decode() {  # two GPUs: 8B TP=1/TP=2 and 70B TP=2 decode at batch 1/8/64, sync and async, beside the floors
  step tp_decode 570 python3 -m benchmarks.bench_tp --parts decode --budget-s 540 --json "$R/tp_decode.json"
}
set_tp_moe() {  # two GPUs: Qwen3-30B-A3B decode on one GPU, over two with experts split, and expert-parallel
  step tp_moe 570 python3 -m benchmarks.bench_tp --parts decode --budget-s 540 --configs qwen3-30b-a3b:1 \
    qwen3-30b-a3b:2 qwen3-30b-a3b:2:ep --batches 1 8 64 --json "$R/tp_moe.json"
}
set_kv_budget() {  # the activation peak and KV budget per model (KV_BUDGET_ROWS: "model:utilization[:profile-attention]",
  # one process each; default Llama-3-8B at 0.9 and Qwen3-30B-A3B at 0.51 (on an H200, the room 0.9 leaves on an 80 GB
  # H100), each also with the profile's attention run by the torch reference, the old profile, as the baseline)
  local row model util flag tag
  for row in ${KV_BUDGET_ROWS:-llama3-8b:0.9 llama3-8b:0.9:profile-attention qwen3-30b-a3b:0.51 \
      qwen3-30b-a3b:0.51:profile-attention}; do
    IFS=: read -r model util flag <<< "$row"
    tag=kv_budget_${row//[^A-Za-z0-9_]/_}
    step "$tag" 200 python3 -m benchmarks.bench_kv_budget --model "$model" --gpu-memory-utilization "$util" \
      ${flag:+--$flag} --json "$R/$tag.json"
  done
}
set_exact_sizes() {  # -O2's exact-size artifacts against the range artifact, one process, arms alternated
  step exact_sizes 300 python3 -m benchmarks.bench_exact_sizes --rounds 2 --budget-s 270 --json "$R/exact_sizes.json"
}
set_structured() {  # grammar compile and cache-hit times, the JSON-schema-constrained step against the free one
  step structured 180 python3 -m benchmarks.bench_structured --model llama3-8b --device cuda --level 2 \
    --tokenizer synthetic --batches 1 16 64 --steps 32 --json "$R/structured.json"
}
set_moe() {  # the MoE GPU tests, a launch-config sweep at Qwen3-30B-A3B's layer, then decode/offline with it
  # (MOE_TUNE_BUCKETS="1 2 4": only those token counts swept, the shipped table's other entries kept;
  # MOE_TUNE_BUDGET_S: the sweep's bound, default 50; MOE_PARTS: bench_moe's parts)
  local tests=tests/gpu/test_moe_gpu.py; [ -n "${MOE_SKIP_OP_TESTS:-}" ] && tests=""
  step moe_tests 240 python3 -m pytest -q -p no:cacheprovider $tests \
    tests/runtime/test_kernel_warmup.py::test_moe_shapes_are_the_distinct_expert_layers
  cp kiln/models/fused_moe/configs/h200.json "$R/fused_moe_h200.json"
  local budget=${MOE_TUNE_BUDGET_S:-50}
  step moe_tune $((budget + 25)) python3 -m benchmarks.tune_fused_moe --budget-s "$budget" \
    ${MOE_TUNE_BUCKETS:+--buckets $MOE_TUNE_BUCKETS} --out "$R/fused_moe_h200.json"
  local table=""  # the sweep's table when it left one, else the shipped table
  [ -s "$R/fused_moe_h200.json" ] && table="$R/fused_moe_h200.json"
  KILN_FUSED_MOE_CONFIGS="$table" step moe 330 python3 -m benchmarks.bench_moe --parts ${MOE_PARTS:-layer decode offline} \
    --json "$R/moe.json"
}
set_moe_ab() {  # the MoE op tests on the GPU, then Qwen3-30B-A3B's decode step at batch 1/8/64 profiled with the code in
  # .ab/base (`git archive <commit> kiln benchmarks | tar -x -C .ab/base`, carried) and with the working tree, alternated
  [ -n "${MOE_AB_SKIP_TESTS:-}" ] || step moe_op_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/models/test_fused_moe.py tests/gpu/test_moe_gpu.py
  for arm in base new; do
    local dir=$PWD; [ "$arm" = base ] && dir=$PWD/.ab/base  # its own kiln in every process (compile workers too)
    PYTHONPATH=$dir:/tmp/site step "moe_profile_$arm" 170 bash -c "cd $dir && exec python3 -m benchmarks.bench_profile \
      --configs qwen3-30b-a3b:1:bf16 --batches 1 8 64 --steps 12 --json $R/moe_profile_$arm.json"
  done
}
set_moe_decode() {  # Qwen3-30B-A3B decode at batch 1/8/64 and offline beside the floors (the shipped launch table), and
  # its batch-1/8 step's kernels (MOE_OP_TESTS=1: the op tests on the GPU first; MOE_PARTS: bench_moe's parts)
  [ -z "${MOE_OP_TESTS:-}" ] || step moe_op_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/models/test_fused_moe.py tests/gpu/test_moe_gpu.py
  step moe_decode 300 python3 -m benchmarks.bench_moe --parts ${MOE_PARTS:-decode offline} --json "$R/moe.json"
  [ -n "${MOE_SKIP_PROFILE:-}" ] || step moe_profile 170 python3 -m benchmarks.bench_profile --configs qwen3-30b-a3b:1:bf16 --batches 1 8 --steps 12 \
    --json "$R/moe_profile.json"
}
set_spec_verify() {  # speculative decoding: a verify step (k = 4) against a plain decode step, Llama-3-8B shape; then
  # the same on the SmolLM2-135M shape with each kind of step profiled (kernels, GPU idle, host calls)
  step spec_verify 125 python3 -m benchmarks.bench_spec_decode --device cuda --skip-tasks --verify-ratio \
    --capture-sizes 1 2 4 8 16 --background-timeout 40 --json "$R/spec_verify.json"
  step spec_verify_smollm2 125 python3 -m benchmarks.bench_spec_decode --device cuda --skip-tasks --verify-ratio \
    --ratio-model smollm2-135m --capture-sizes 1 2 4 8 16 --background-timeout 40 --profile-steps 8 \
    --json "$R/spec_verify_smollm2.json"
}
embedded_gguf() {  # the embedded model's GGUF (~94 MiB) travels as `split -n 2` halves .carry/smollm2-{a,b}.part, one
  # per call of a warm machine; -> its path once both have arrived, else nothing
  local gguf=/tmp/parts/SmolLM2-135M-Instruct.Q4_1.gguf
  [ "$(ls /tmp/parts/smollm2-*.part 2>/dev/null | wc -l)" = 2 ] || return 1
  cat /tmp/parts/smollm2-a.part /tmp/parts/smollm2-b.part > $gguf && echo $gguf
}
set_spec_tasks() {  # n-gram speculation on the embedded model's copy / edit / free tasks, k = 4 to 15, and the
  # arm whose verify steps drain the step in flight (the A/B of verifying behind it; SPEC_DRAIN_ARM="" leaves it out)
  local gguf; gguf=$(embedded_gguf) || { echo "spec_tasks: skipped, the embedded model's two halves have not both arrived"; return; }
  local run
  for run in $(seq "${SPEC_TASK_RUNS:-1}"); do  # SPEC_TASK_RUNS=3: three processes per k (the spread between them)
    for k in ${SPEC_TASK_KS:-4 8 12 15}; do  # SPEC_TASK_KS="8 15": a subset
      KILN_EMBEDDED_GGUF=$gguf step "spec_tasks_k${k}_$run" 110 python3 -m benchmarks.bench_spec_decode --device cuda \
        --max-tokens 128 --capture-sizes 1 2 4 8 16 --background-timeout 30 --repeats 5 -k $k ${SPEC_DRAIN_ARM---drain-arm} \
        --json "$R/spec_tasks_k${k}_$run.json"
    done
  done
}
set_spec_ab() {  # spec-tasks with the code in .ab/base (`git archive <commit> kiln benchmarks | tar -x -C .ab/base`, carried)
  # and with the working tree, processes alternated SPEC_AB_ROUNDS times (default 2) at each k of SPEC_TASK_KS (default 12)
  local gguf; gguf=$(embedded_gguf) || { echo "spec_ab: skipped, the embedded model's two halves have not both arrived"; return; }
  local run k arm dir
  for run in $(seq "${SPEC_AB_ROUNDS:-2}"); do
    for k in ${SPEC_TASK_KS:-12}; do
      for arm in base new; do
        dir=$PWD; [ "$arm" = base ] && dir=$PWD/.ab/base  # its own kiln in every process
        KILN_EMBEDDED_GGUF=$gguf PYTHONPATH=$dir:/tmp/site step "spec_${arm}_k${k}_$run" 110 bash -c "cd $dir && exec \
          python3 -m benchmarks.bench_spec_decode --device cuda --max-tokens 128 --capture-sizes 1 2 4 8 16 \
          --background-timeout 30 --repeats 5 -k $k --json $R/spec_${arm}_k${k}_$run.json"
      done
    done
  done
}
each_arm() {  # FN for each arm of ARMS ("base": .ab/base's code, "new": the working tree, NAME=VALUE[,NAME=VALUE]:
  # the working tree with those environment variables), processes alternated ROUNDS times; FN gets the code's
  # directory and the arm's tag and round
  local run arm dir tag
  for run in $(seq "$ROUNDS"); do
    for arm in $ARMS; do
      dir=$PWD; [ "$arm" = base ] && dir=$PWD/.ab/base
      tag=${arm//[^A-Za-z0-9_]/_}
      (
        export_vars "$arm"
        export PYTHONPATH=$dir:/tmp/site
        "$1" "$dir" "$tag" "$run"
      )
    done
  done
}
set_decode_ab() {  # decode at default settings (DECODE_AB_MODELS, default SmolLM2-135M, "none" for no dense model;
  # DECODE_AB_ARGS: more bench_gpu arguments, e.g. --quantization fp8) in each arm of DECODE_AB_ARMS (default
  # "base new", each_arm), processes alternated DECODE_AB_ROUNDS times (2). DECODE_AB_MOE=1: Qwen3-30B-A3B's decode
  # (bench_moe --parts decode) in each arm too. DECODE_AB_LABEL: the steps' and files' prefix (default decode), for
  # a second decode-ab in the same call
  local label=${DECODE_AB_LABEL:-decode}
  decode_arm() {
    [ "${DECODE_AB_MODELS:-}" = none ] || step "${label}_$2_$3" 200 bash -c "cd $1 && exec python3 -m \
      benchmarks.bench_gpu decode --defaults --backend triton --models ${DECODE_AB_MODELS:-smollm2-135m} \
      --async-scheduling on ${DECODE_AB_ARGS:-} --json $R/${label}_$2_$3.json"
    [ -z "${DECODE_AB_MOE:-}" ] || step "moe_decode_$2_$3" 240 bash -c "cd $1 && exec python3 -m \
      benchmarks.bench_moe --parts decode --json $R/moe_decode_$2_$3.json"
  }
  ARMS=${DECODE_AB_ARMS:-base new} ROUNDS=${DECODE_AB_ROUNDS:-2} each_arm decode_arm
}
set_tp_ab() {  # two GPUs: bench_tp's decode (TP_AB_CONFIGS, default llama3-8b:2; TP_AB_BATCHES, default 1 8 64) in
  # each arm of TP_AB_ARMS (each_arm; default "base new"), processes alternated TP_AB_ROUNDS times (2)
  tp_arm() {
    step "tp_$2_$3" 150 bash -c "cd $1 && exec python3 -m benchmarks.bench_tp --parts decode --budget-s 140 \
      --configs ${TP_AB_CONFIGS:-llama3-8b:2} --batches ${TP_AB_BATCHES:-1 8 64} --json $R/tp_$2_$3.json"
  }
  ARMS=${TP_AB_ARMS:-base new} ROUNDS=${TP_AB_ROUNDS:-2} each_arm tp_arm
}
set_spec_tests() {  # the speculative-decoding GPU tests (greedy equality with graphs, bf16 bit-for-bit at batch 1)
  step spec_tests 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_spec_decode_gpu.py
}
set_test_trees() {  # one GPU test (TREE_TEST, pytest's node id) in several source trees at once, for a bisect: each arm of
  # TREES is a commit whose tree is in .ab/t/COMMIT (`git archive COMMIT kiln tests | tar -x -C .ab/t/COMMIT`, carried)
  # with optional environment variables, COMMIT[:NAME=VALUE[,NAME=VALUE]]; every arm a process with its own caches
  # (the processes share the GPU; a tiny model's test takes ~3.5 min with 12 of them), all bounded by TREE_TEST_S (450)
  local arm tree vars tag pids=()
  for arm in $TREES; do
    tree=${arm%%:*}; vars=""; [ "$arm" != "$tree" ] && vars=${arm#*:}
    tag=tree_${arm//[^A-Za-z0-9_]/_}
    (
      export_vars "$vars"
      export KILN_CACHE_DIR=/tmp/trees/$tag/kiln TORCHINDUCTOR_CACHE_DIR=/tmp/trees/$tag/inductor \
        TRITON_CACHE_DIR=/tmp/trees/$tag/triton PYTHONPATH=$PWD/.ab/t/$tree:/tmp/site
      step "$tag" "${TREE_TEST_S:-450}" bash -c "cd .ab/t/$tree && exec python3 -m pytest -q -p no:cacheprovider -rfE \
        $TREE_TEST"
    ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}
set_tests() {  # the GPU tests (GPU_TESTS: a subset, pytest's arguments split at spaces; in a -k expression write " or " as
  # "_or_", e.g. -k residual_or_dispatch; a -k applies to every file named; GPU_TESTS_S: the step's bound, default 500 s;
  # one cut there still prints the failures so far and the slowest tests: `bounded` interrupts before it kills)
  local args=() word
  for word in ${GPU_TESTS:-tests/gpu}; do args+=("${word//_or_/ or }"); done
  step gpu_tests "${GPU_TESTS_S:-500}" python3 -m pytest -q -p no:cacheprovider -rfE --durations=20 "${args[@]}"
}

BUDGET=570
SETS=()
while [ $# -gt 0 ]; do
  case $1 in
    --budget) BUDGET=$2; shift 2 ;;
    --list) for f in $(declare -F | awk '$3 ~ /^set_/ {print $3}'); do
              echo "${f#set_}:"; declare -f "$f" | sed '1,2d;$d'; done
            exit 0 ;;
    *) SETS+=("$1"); shift ;;
  esac
done

[ ${#SETS[@]} -gt 0 ] || { echo "usage: bash benchmarks/gpu/run.sh [--budget SECONDS] SET... (--list)"; exit 2; }
for name in "${SETS[@]}"; do
  declare -F "set_${name//-/_}" >/dev/null || { echo "unknown set: $name (--list shows them)"; exit 2; }
done

source benchmarks/gpu_call.sh
: > "$R/steps.tsv"  # this call's steps only (a warm machine keeps /tmp between calls)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 4
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), python $(python3 -c 'import sys; print(sys.version.split()[0])')"

# step LABEL SECONDS CMD...: CMD under `bounded`, its output in $L/LABEL.log, its outcome a row of the table
step() {
  local label=$1 t=$2; shift 2
  local cap=$(( $(left "$BUDGET") - 10 ))
  [ "$t" -gt "$cap" ] && t=$cap
  local s; s=$(date +%s)
  bounded "$t" "$@" > "$L/$label.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$label" "$rc" "$(( $(date +%s) - s ))" >> "$R/steps.tsv"
  echo "$label: rc=$rc"
}

for name in "${SETS[@]}"; do "set_${name//-/_}"; done
finish_call 12
echo
echo "| step | rc | seconds | result |"
echo "|---|---|---|---|"
while IFS=$'\t' read -r label rc seconds; do
  result=$(ls "$OUT/$label.json" 2>/dev/null || echo "(in logs.tgz)")
  echo "| $label | $rc | $seconds | $result |"
done < "$R/steps.tsv"
