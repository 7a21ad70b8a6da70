#!/usr/bin/env bash
# The benchmark runner for a GPU machine: runs the steps named on the command line, in that order, each under its
# own timeout inside one budget, and leaves a short results folder: at most 8 files in RESULTS_DIR.
#
#     bash benchmarks/run_gpu.sh [STEP ...]   steps: tests ops decode decode-8b decode-ops decode-norm e2e e2e-compile
#                                             lce losses attention sft lora lora-autocast qlora moe long-context
#                                             long-context-curves qk-norm-rope decode-int4 decode-fp8 decode-70b
#                                             quant-sweep decode-70b-tuned decode-int4-tuned decode-quant-profile
#                                             rms-norm-hidden quant-read-floor
#
#   tests       the README's test command, natively: python -m pytest tests -v -n TEST_WORKERS (12) under TESTS_CAP_S
#               (565 s), on a machine of several GPUs one such process a GPU over a share of the test files;
#               failures named as they happen (tests.log; the run log gets them and the summary), each one's
#               traceback in failures.log as it happens (copied into RESULTS_DIR every 15 s while the tests run);
#               TESTS="tests/memory tests/test_optim.py" runs those paths instead of the whole suite
#   ops         gpu-check without its tests: ceilings and every op benchmark (<gpu>_ops.md, <gpu>_ops.json)
#   decode      decode: tigon at batch 1 and 8 beside HF static cache + compile at batch 1
#               (<gpu>_decode.md, <gpu>_decode.json)
#   decode-8b   decode --model llama3-8b: tigon and HF static cache + compile at batch 1 and 8, prompts
#               DECODE_8B_PROMPTS (default 512,8192), with the weight + KV read bound (<gpu>_decode_8b.md, .json);
#               with BASELINE also that tree's tigon rows at prompt 512 (<gpu>_decode_8b_base.md)
#   decode-int4 decode-fp8  decode --model llama3-8b --weights int4|fp8: tigon at batch 1 and 8 beside the same model
#               in bf16 (tigon-bf16, batch 1: the TTFT reference) and HF's generate
#               on the same quantized model (and, int4, torchao's int4 + compile) at batch 1, prompts
#               DECODE_QUANT_PROMPTS (default 512) (<gpu>_decode-int4.md, .json); torchao from .whl/
#   decode-70b  decode --model llama3-70b --weights int4: the 70B shape (random init, built layer by layer and
#               quantized at once) at batch 1, prompt 512, into a 32K ring, with its read bound (<gpu>_decode_70b.md)
#   decode-70b-tuned  tigon tune --quant-linear --model llama3-70b into a cache of this run (the 70B shapes' picks),
#               then decode-70b reading it (TIGON_CACHE_DIR): the tuned step beside the untuned one of decode-70b
#               (<gpu>_tune_70b.txt, <gpu>_decode_70b_tuned.md)
#   decode-int4-tuned  decode --model llama3-8b --weights int4, tigon at batch 1 and 8, prompt 512: with the shipped
#               picks, then with this card's own (tigon tune --quant-linear into a cache of this run): an A/B of
#               the picks in one call (<gpu>_tune_8b.txt, <gpu>_decode_int4_ab.md)
#   rms-norm-hidden  tune --ops rms_norm_hidden: rms_norm fwd+bwd at 65536 x 1024 and 32768 x 2048 over backward
#               warps, programs an SM and tiles of rows (<gpu>_rms_norm_hidden_tune.json)
#   decode-quant-profile  decode --model llama3-8b --weights DECODE_PROFILE_WEIGHTS (int4) --profile: tigon at batch 1
#               and 8, prompt 512, each step's kernel times (<gpu>_decode_int4_profile.md, .json)
#   quant-read-floor  quant-linear --rows 1 8 --kinds int4 fp8 --read-floor: the default decode launches beside the
#               fastest Triton kernel that only reads each weight's codes (<gpu>_quant_read_floor.txt, .json)
#   quant-sweep quant-linear --sweep --rows QUANT_SWEEP_ROWS (1 8) --kinds QUANT_SWEEP_KINDS (int4 fp8): each
#               shape's best launch of the grid, the default's time and the code-MMA kernel's best, from CUDA graphs,
#               row by row (<gpu>_quant_sweep.txt, .json); QUANT_SWEEP_ROWS="512 4096" times the prefill GEMMs;
#               QUANT_SWEEP_ARGS adds arguments ("--mma-only": the code-MMA configs only)
#   decode-ops  decode-ops --quick: the decode kernels' defaults vs cuBLAS (<gpu>_decode_ops.md, .json)
#   decode-norm decode-ops --norm-cost at the 8B and 1.5B shapes: decode_linear with and without its fused
#               norm, at the statistics steps NORM_STATS_ELEMS (default 0,2048,4096), and the norm as its own launch
#               (<gpu>_decode_norm_<model>.json)
#   e2e         e2e: the 1.5B training step, E2E_VARIANTS (tigon,liger) of E2E_CONFIGS (llama; also qwen3,
#               gemma2) (<gpu>_e2e.md, <gpu>_e2e.json)
#   e2e-compile e2e --compile: torch.compile over HF, over a patched model (default mode and reduce-overhead's
#               CUDA graphs), and patched alone; E2E_COMPILE_VARIANTS overrides the non-default ones (<gpu>_e2e_compile.md)
#   lce         cross-entropy --only linear_cross_entropy,flce_completion_only: the fused linear CE beside its
#               peers, all rows labelled and half of them -100 (<gpu>_lce.md)
#   losses      losses: DPO, GRPO, JSD fused-linear losses beside eager, TRL's head and Liger (<gpu>_losses.md)
#   attention   training-attention --write-table: each backend per mask, and hf/attention_table.py's rows
#               (<gpu>_attention.md)
#   sft         sft-packed: padded HF / Liger / Tigon vs packed Tigon on a length mix (<gpu>_sft.md)
#   qlora       lora's QLoRA rows (NF4 decoder projections; needs bitsandbytes): liger / tigon (<gpu>_qlora.md)
#   moe         moe: one Qwen3-30B-A3B experts block, HF eager / grouped_mm / tigon (<gpu>_moe.md)
#   lora        lora: the 8B PEFT LoRA job (checkpointing, 2 x 4096), liger / tigon-nolora / tigon (<gpu>_lora.md)
#   lora-autocast  the same job's forward under bf16 autocast (the Trainer's bf16=True), liger / tigon / tigon-kept
#               (every layer without the recompute) (<gpu>_lora_autocast.md)
#   long-context long-context --variants liger,tigon,tigon-offload --seqs 16384,65536: the 8B LoRA job's peak and
#               step time per length beside Liger's (<gpu>_long_context.md, .json)
#   long-context-curves long-context --curve-steps 30 --deterministic: 30-step loss curves of tigon, the offload and
#               the offload + tiled MLP with LoRA dropout, compared bit for bit (<gpu>_long_context_curves.md)
#   qk-norm-rope norms --only qk_norm_rope: the fused QK-norm + RoPE beside tigon's two ops, torch.compile, Liger
#               and eager at Qwen3's head_dim 64 and 128 (<gpu>_qk_norm_rope.md, <gpu>_qk_norm_rope.json), then
#               tune --ops qk_norm_rope: the QKNormRopeConfig sweep (<gpu>_qk_norm_rope_tune.json)
#
# <gpu> is the GPU's short name ("h200"), as in benchmarks/results/<gpu>.md, whose tables these files refresh.
# RESULTS_DIR is the folder it writes (default ./tigon-bench-results). BUDGET_S bounds the whole run (default 585 s).
# DECODE_VARIANTS overrides the decode step's variants.
# Each benchmark runs as `python3 -m benchmarks NAME` from the tree's root (`python3 -m benchmarks --list` names them).
# BASELINE=DIR (a tree with src/ and benchmarks/ of another commit) adds, to decode, decode-8b and e2e, a run of that
# tree in the same run, for side-by-side numbers (<gpu>_decode_base.md, <gpu>_e2e_base.md): a tree whose benchmarks/ is
# the package runs `python3 -m benchmarks NAME` from its own root; an older tree, its flat scripts
# (benchmarks/bench_decode.py, or `python3 -m tigon.bench_decode` before those). Wheels in .whl/ (for
# packages the machine lacks: pytest-xdist, liger-kernel, bitsandbytes, ...) are installed offline into /tmp/site first.
# Each step's tables come first; logs and plots are kept while fewer than 7 files are in RESULTS_DIR; everything every
# step wrote (JSON, logs, the rewritten attention table) also goes into RESULTS_DIR/raw.tgz.
# Exit status: the number of steps that failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${RESULTS_DIR:-$PWD/tigon-bench-results}"
BUDGET="${BUDGET_S:-585}"
mkdir -p "$RESULTS"
LOG="$RESULTS/run.log"
: >"$LOG"
failed=0
extras=()  # "SRC DST" pairs copied at the end while there is room
exec 3>&1  # the runner's own stdout: log lines reach it even from inside a step redirected to run.log
log() { local m; m="[$(date +%T) +${SECONDS}s] $*"; echo "$m" >>"$LOG"; echo "$m" >&3; }

step() {  # step NAME CAP_S CMD...: CMD under timeout min(CAP_S, what is left of the budget)
    local name="$1" cap="$2" limit
    shift 2
    limit=$(( BUDGET - SECONDS ))
    (( limit > cap )) && limit=$cap
    if (( limit < 20 )); then log "SKIP $name: ${limit} s left"; failed=$((failed + 1)); return; fi
    log "START $name (timeout ${limit} s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if (( rc == 0 )); then log "DONE $name"; else log "FAILED $name: exit $rc"; failed=$((failed + 1)); fi
}

keep() {  # keep SRC DST: copy SRC to $RESULTS/DST while $RESULTS holds fewer than 7 files (the 8th is raw.tgz)
    [[ -f "$1" ]] || return 0
    if (( $(find "$RESULTS" -type f | wc -l) < 7 )); then cp "$1" "$RESULTS/$2"; else log "not kept (7 files in $RESULTS): $2"; fi
}

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
        || log "pip: some wheels were not installed (run.log)"
fi
export PYTHONPATH="src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    git log -1 --format='commit %H %s' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    python3 -c "import torch, triton, transformers, numpy; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" 2>&1
} | tee -a "$LOG"
# The GPU's short name, by gpu_check.py's rule: "NVIDIA H200" -> "h200"; "cpu" without a GPU.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr '[:upper:]' '[:lower:]' \
      | sed -e 's/nvidia//' -e 's/[^a-z0-9]\{1,\}/_/g' -e 's/^_//' -e 's/_$//')
GPU="${GPU:-cpu}"

bench=(python3 -m benchmarks)  # this tree's benchmarks package (the working directory is its root)
# The baseline tree first on the path, its benchmarks by its own layout: the package (run from its root, so that
# `-m benchmarks` finds its package and not this tree's), the flat scripts, or the decode bench inside tigon.
[[ -n "${BASELINE:-}" ]] && BASELINE=$(cd "$BASELINE" && pwd)  # absolute: the package layout runs from its root
if [[ -n "${BASELINE:-}" && -f "$BASELINE/benchmarks/__main__.py" ]]; then
    base=(env -C "$BASELINE" PYTHONPATH="$BASELINE/src:/tmp/site")
    base_decode=(python3 -m benchmarks decode); base_e2e=(python3 -m benchmarks e2e)
else
    base=(env PYTHONPATH="${BASELINE:-}/src:/tmp/site:${BASELINE:-}/benchmarks")
    base_decode=(python3 "${BASELINE:-}/benchmarks/bench_decode.py")
    base_e2e=(python3 "${BASELINE:-}/benchmarks/bench_e2e.py")
    [[ -n "${BASELINE:-}" && ! -f "$BASELINE/benchmarks/bench_decode.py" ]] \
        && base_decode=(python3 -m tigon.bench_decode)
fi
T=/tmp/run_gpu
rm -rf "$T" && mkdir -p "$T"

run_tests() {  # the suite (or TESTS) over every GPU of the machine: one pytest process a GPU, the test files dealt
    # round-robin, TEST_WORKERS workers each; logs $T/tests_gpu<i>.log (written as they run)
    local n i j rc=0 files part pids=()
    n=$(nvidia-smi -L 2>/dev/null | wc -l)
    (( n > 0 )) || n=1
    mapfile -t files < <(for t in ${TESTS:-tests}; do
                             if [[ -d $t ]]; then find "$t" -name 'test_*.py'; else echo "$t"; fi; done | sort)
    for (( i = 0; i < n; i++ )); do
        part=()
        for (( j = i; j < ${#files[@]}; j += n )); do part+=("${files[j]}"); done
        (( ${#part[@]} )) || continue
        CUDA_VISIBLE_DEVICES=$i python3 -m pytest "${part[@]}" -v -n "${TEST_WORKERS:-12}" -rfE --durations=15 \
            -o cache_dir="/tmp/pytest_cache_$i" -p no:randomly --failure-log "$T/failures.log" \
            >"$T/tests_gpu$i.log" 2>&1 &
        pids+=($!)
    done
    for j in "${pids[@]}"; do wait "$j" || rc=1; done
    return $rc
}
export -f run_tests
export T

for s in "$@"; do
    case "$s" in
        tests) (while sleep 15; do cp "$T/failures.log" "$RESULTS/failures.log" 2>/dev/null; done) & mirror=$!
               step tests "${TESTS_CAP_S:-565}" bash -c run_tests
               kill "$mirror" 2>/dev/null; rm -f "$RESULTS/failures.log"; keep "$T/failures.log" failures.log
               cat "$T"/tests_gpu*.log >"$T/tests.log" 2>/dev/null
               # -v: each failure's name is in the log as it happens, so a run cut off by its limit still names them
               grep -E "(FAILED|ERROR) tests/|^(FAILED|ERROR) | (passed|failed)" "$T/tests.log" | sort -u | tail -n 40 \
                   | tee -a "$LOG"; keep "$T/tests.log" tests.log ;;
        ops) step ops 300 "${bench[@]}" gpu-check --no-tests --out "$T/ops" --tag "${GPU}_ops" --budget 280 \
                 >>"$LOG" 2>&1
             keep "$T/ops/${GPU}_ops.md" "${GPU}_ops.md"; keep "$T/ops/${GPU}_ops.json" "${GPU}_ops.json"
             extras+=("$T/ops/gpu_check.log gpu_check.log")
             for p in "$T"/ops/*.png; do extras+=("$p $(basename "$p")"); done ;;
        decode)
            step decode 200 "${bench[@]}" decode --out "$T/decode" \
                --variants "${DECODE_VARIANTS:-tigon,hf-static-compile@1}" --batches 1,8 --budget 190 >>"$LOG" 2>&1
            keep "$T/decode/decode.md" "${GPU}_decode.md"; keep "$T/decode/decode.json" "${GPU}_decode.json"
            extras+=("$T/decode/decode_latency.png ${GPU}_decode_latency.png")
            if [[ -n "${BASELINE:-}" ]]; then
                step decode-base 150 "${base[@]}" "${base_decode[@]}" --out "$T/decode_base" \
                    --variants tigon --batches 1,8 --budget 140 >>"$LOG" 2>&1
                keep "$T/decode_base/decode.md" "${GPU}_decode_base.md"
                extras+=("$T/decode_base/decode.json ${GPU}_decode_base.json")
            fi ;;
        decode-8b)  # the bench's budget ends 30 s before the step's timeout, so it writes its tables
            b8=$(( BUDGET - SECONDS - 30 )); (( b8 > 550 )) && b8=550
            step decode-8b 580 "${bench[@]}" decode --model llama3-8b --out "$T/decode_8b" \
                --variants "${DECODE_8B_VARIANTS:-tigon,hf-static-compile}" --batches 1,8 \
                --prompts "${DECODE_8B_PROMPTS:-512,8192}" --budget "$(( b8 > 1 ? b8 : 1 ))" >>"$LOG" 2>&1
            keep "$T/decode_8b/decode.md" "${GPU}_decode_8b.md"; keep "$T/decode_8b/decode.json" "${GPU}_decode_8b.json"
            extras+=("$T/decode_8b/decode_latency.png ${GPU}_decode_8b_latency.png")
            if [[ -n "${BASELINE:-}" ]]; then  # the baseline tree's tigon rows at prompt 512, for an A/B in the same run
                step decode-8b-base 200 "${base[@]}" "${base_decode[@]}" --model llama3-8b --out "$T/decode_8b_base" \
                    --variants tigon --batches 1,8 --prompts 512 --budget 190 >>"$LOG" 2>&1
                keep "$T/decode_8b_base/decode.md" "${GPU}_decode_8b_base.md"
                extras+=("$T/decode_8b_base/decode.json ${GPU}_decode_8b_base.json")
            fi ;;
        decode-int4|decode-fp8)  # the quantized 8B step beside HF's generate on the same model (and torchao's int4)
            w=${s#decode-}; peers=tigon-bf16@1,hf-static-compile@1; [[ $w == int4 ]] && peers+=",torchao-static-compile@1"
            bq=$(( BUDGET - SECONDS - 30 )); (( bq > 550 )) && bq=550
            step "$s" 580 "${bench[@]}" decode --model llama3-8b --weights "$w" --out "$T/$s" \
                --variants "tigon,$peers" --batches 1,8 --prompts "${DECODE_QUANT_PROMPTS:-512}" \
                --budget "$(( bq > 1 ? bq : 1 ))" >>"$LOG" 2>&1
            keep "$T/$s/decode.md" "${GPU}_$s.md"; keep "$T/$s/decode.json" "${GPU}_$s.json" ;;
        decode-70b)  # the 70B shape in int4 (built layer by layer, quantized at once), tigon at batch 1
            bq=$(( BUDGET - SECONDS - 20 )); (( bq > 280 )) && bq=280
            step decode-70b 300 "${bench[@]}" decode --model llama3-70b --weights int4 --out "$T/decode_70b" \
                --variants tigon --batches 1 --prompts 512 --budget "$(( bq > 1 ? bq : 1 ))" >>"$LOG" 2>&1
            keep "$T/decode_70b/decode.md" "${GPU}_decode_70b.md"; keep "$T/decode_70b/decode.json" "${GPU}_decode_70b.json" ;;
        decode-70b-tuned)  # the 70B shapes' quant_linear picks measured here, then the 70B step that reads them
            mkdir -p "$T/tune_70b"
            step tune-70b 240 python3 -m tigon.cli tune --quant-linear --quant-formats int4 --quant-rows 1 \
                --model llama3-70b --cache "$T/tune_70b/tuned.json" --times "$T/tune_70b/times.json" >"$T/tune_70b.txt" 2>&1
            keep "$T/tune_70b.txt" "${GPU}_tune_70b.txt"; keep "$T/tune_70b/times.json" "${GPU}_tune_70b_times.json"
            bq=$(( BUDGET - SECONDS - 20 )); (( bq > 280 )) && bq=280
            step decode-70b-tuned 300 env TIGON_CACHE_DIR="$T/tune_70b" "${bench[@]}" decode --model llama3-70b \
                --weights int4 --out "$T/decode_70b_tuned" --variants tigon --batches 1 --prompts 512 \
                --budget "$(( bq > 1 ? bq : 1 ))" >>"$LOG" 2>&1
            keep "$T/decode_70b_tuned/decode.md" "${GPU}_decode_70b_tuned.md" ;;
        decode-int4-tuned)  # the 8B int4 step on the shipped picks, then on picks tuned here, in one call
            mkdir -p "$T/tune_8b" "$T/no_cache"
            step decode-int4-shipped 160 env TIGON_CACHE_DIR="$T/no_cache" "${bench[@]}" decode --model llama3-8b \
                --weights int4 --out "$T/decode_int4_shipped" --variants tigon --batches 1,8 --prompts 512 \
                --budget 140 >>"$LOG" 2>&1
            step tune-8b 240 python3 -m tigon.cli tune --quant-linear --quant-formats int4 --quant-rows 1,8 \
                --model llama3-8b --cache "$T/tune_8b/tuned.json" --times "$T/tune_8b/times.json" >"$T/tune_8b.txt" 2>&1
            keep "$T/tune_8b.txt" "${GPU}_tune_8b.txt"; keep "$T/tune_8b/times.json" "${GPU}_tune_8b_times.json"
            step decode-int4-tuned 160 env TIGON_CACHE_DIR="$T/tune_8b" "${bench[@]}" decode --model llama3-8b \
                --weights int4 --out "$T/decode_int4_tuned" --variants tigon --batches 1,8 --prompts 512 \
                --budget 140 >>"$LOG" 2>&1
            cat "$T/decode_int4_shipped/decode.md" "$T/decode_int4_tuned/decode.md" >"$T/decode_int4_ab.md" 2>/dev/null
            keep "$T/decode_int4_ab.md" "${GPU}_decode_int4_ab.md" ;;
        decode-quant-profile)  # where the quantized 8B step's time goes at batch 1 and 8 (kernel times per step)
            w=${DECODE_PROFILE_WEIGHTS:-int4}
            step decode-quant-profile 200 "${bench[@]}" decode --model llama3-8b --weights "$w" \
                --out "$T/decode_quant_profile" --variants tigon --batches 1,8 --prompts 512 --profile --budget 180 \
                >>"$LOG" 2>&1
            keep "$T/decode_quant_profile/decode.md" "${GPU}_decode_${w}_profile.md"
            keep "$T/decode_quant_profile/decode.json" "${GPU}_decode_${w}_profile.json" ;;
        quant-read-floor)  # quant_linear's decode rows beside a kernel that only reads each weight's codes
            step quant-read-floor 200 "${bench[@]}" quant-linear --rows 1 8 --kinds int4 fp8 --read-floor \
                --out "$T/quant_read_floor.json" >"$T/quant_read_floor.txt" 2>&1
            keep "$T/quant_read_floor.txt" "${GPU}_quant_read_floor.txt"
            keep "$T/quant_read_floor.json" "${GPU}_quant_read_floor.json" ;;
        quant-sweep)  # quant_linear's launch grid at the decode rows, timed from CUDA graphs: the picks for _plan
            step quant-sweep 300 "${bench[@]}" quant-linear --sweep --rows ${QUANT_SWEEP_ROWS:-1 8} \
                --kinds ${QUANT_SWEEP_KINDS:-int4 fp8} ${QUANT_SWEEP_ARGS:-} \
                --out "$T/quant_sweep.json" >"$T/quant_sweep.txt" 2>&1
            keep "$T/quant_sweep.txt" "${GPU}_quant_sweep.txt"; keep "$T/quant_sweep.json" "${GPU}_quant_sweep.json" ;;
        decode-norm)
            for model in llama3-8b 1.5b; do
                mkdir -p "$T/decode_norm"
                step "decode-norm-$model" 120 "${bench[@]}" decode-ops --model "$model" --norm-cost \
                    --stats-elems "${NORM_STATS_ELEMS:-0,2048,4096}" --out "$T/decode_norm" >>"$LOG" 2>&1
                keep "$T/decode_norm/decode_norm_cost_$model.json" "${GPU}_decode_norm_$model.json"
            done ;;
        decode-ops) step decode-ops 100 "${bench[@]}" decode-ops --out "$T/decode_ops" --quick >>"$LOG" 2>&1
            keep "$T/decode_ops/decode_ops.md" "${GPU}_decode_ops.md"
            keep "$T/decode_ops/decode_ops.json" "${GPU}_decode_ops.json" ;;
        e2e)
            step e2e 420 "${bench[@]}" e2e --out "$T/e2e" --variants "${E2E_VARIANTS:-tigon,liger}" \
                --configs "${E2E_CONFIGS:-llama}" >>"$LOG" 2>&1
            keep "$T/e2e/e2e.md" "${GPU}_e2e.md"; keep "$T/e2e/e2e.json" "${GPU}_e2e.json"
            if [[ -n "${BASELINE:-}" ]]; then
                step e2e-base 150 "${base[@]}" "${base_e2e[@]}" \
                    --out "$T/e2e_base" --variants tigon >>"$LOG" 2>&1
                keep "$T/e2e_base/e2e.md" "${GPU}_e2e_base.md"
                extras+=("$T/e2e_base/e2e.json ${GPU}_e2e_base.json")
            fi ;;
        e2e-compile)
            step e2e-compile 420 "${bench[@]}" e2e --out "$T/e2e_compile" \
                --variants "${E2E_COMPILE_VARIANTS:-tigon,tigon_compile_graphs}" --compile \
                >>"$LOG" 2>&1
            keep "$T/e2e_compile/e2e.md" "${GPU}_e2e_compile.md" ;;
        lce) mkdir -p "$T/lce"
             step lce 300 "${bench[@]}" cross-entropy --only linear_cross_entropy,flce_completion_only --budget 290 \
                 --json "$T/lce/lce.json" >"$T/lce/lce.md" 2>>"$LOG"
             keep "$T/lce/lce.md" "${GPU}_lce.md" ;;
        losses) step losses 300 "${bench[@]}" losses --out "$T/losses" --budget 290 >>"$LOG" 2>&1
            keep "$T/losses/losses.md" "${GPU}_losses.md" ;;
        attention)
            step attention 360 "${bench[@]}" training-attention --out "$T/attention" --budget 350 \
                --write-table >>"$LOG" 2>&1
            mkdir -p "$T/attention" && cp src/tigon/hf/attention_table.py "$T/attention/" 2>/dev/null
            for f in "$T"/attention/*.md; do keep "$f" "${GPU}_attention.md"; done ;;
        sft) step sft 300 "${bench[@]}" sft-packed --out "$T/sft" >>"$LOG" 2>&1
            for f in "$T"/sft/*.md; do keep "$f" "${GPU}_sft.md"; done ;;
        moe) step moe 200 "${bench[@]}" moe --out "$T/moe" >>"$LOG" 2>&1
            keep "$T/moe/moe.md" "${GPU}_moe.md" ;;
        qlora) step qlora 200 "${bench[@]}" lora --variants liger-qlora,tigon-qlora --out "$T/qlora" --steps 3 \
                   --timeout 90 >>"$LOG" 2>&1
            keep "$T/qlora/lora.md" "${GPU}_qlora.md" ;;
        lora) step lora 300 "${bench[@]}" lora --out "$T/lora" --steps 4 --timeout 95 >>"$LOG" 2>&1
            keep "$T/lora/lora.md" "${GPU}_lora.md" ;;
        lora-autocast) step lora-autocast 300 "${bench[@]}" lora --autocast --variants liger,tigon,tigon-kept \
                           --out "$T/lora_autocast" --steps 4 --timeout 100 >>"$LOG" 2>&1
            keep "$T/lora_autocast/lora.md" "${GPU}_lora_autocast.md" ;;
        long-context) step long-context 420 "${bench[@]}" long-context --variants liger,tigon,tigon-offload \
                          --seqs 16384,65536 --out "$T/long_context" --timeout 130 >>"$LOG" 2>&1
            keep "$T/long_context/long_context.md" "${GPU}_long_context.md"
            keep "$T/long_context/long_context.json" "${GPU}_long_context.json" ;;
        long-context-curves) step long-context-curves 240 "${bench[@]}" long-context --variants '' \
                                 --curve-steps 30 --deterministic --out "$T/long_context_curves" --timeout 55 \
                                 >>"$LOG" 2>&1
            keep "$T/long_context_curves/long_context.md" "${GPU}_long_context_curves.md" ;;
        rms-norm-hidden) mkdir -p "$T/rms_norm_hidden"  # rms_norm's launches at hidden 1024 and 2048
            step rms-norm-hidden 150 "${bench[@]}" tune --ops rms_norm_hidden --out "$T/rms_norm_hidden" >>"$LOG" 2>&1
            keep "$T/rms_norm_hidden/tune.json" "${GPU}_rms_norm_hidden_tune.json" ;;
        qk-norm-rope) mkdir -p "$T/qk_norm_rope"
            step qk-norm-rope 240 "${bench[@]}" norms --only qk_norm_rope --budget 200 \
                --json "$T/qk_norm_rope/qk_norm_rope.json" >"$T/qk_norm_rope/qk_norm_rope.md" 2>>"$LOG"
            keep "$T/qk_norm_rope/qk_norm_rope.md" "${GPU}_qk_norm_rope.md"
            keep "$T/qk_norm_rope/qk_norm_rope.json" "${GPU}_qk_norm_rope.json"
            step qk-norm-rope-tune 180 "${bench[@]}" tune --ops qk_norm_rope --out "$T/qk_norm_rope" >>"$LOG" 2>&1
            keep "$T/qk_norm_rope/tune.json" "${GPU}_qk_norm_rope_tune.json" ;;
        *) log "unknown step: $s"; failed=$((failed + 1)) ;;
    esac
done
for e in "${extras[@]+"${extras[@]}"}"; do keep ${e}; done
cp "$LOG" "$T/run.log" 2>/dev/null; tar czf "$RESULTS/raw.tgz" -C "$T" . 2>/dev/null || log "raw.tgz not written"
log "finished: $failed failed step(s); in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
exit "$failed"
