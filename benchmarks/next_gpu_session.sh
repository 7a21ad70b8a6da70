#!/usr/bin/env bash
# One device call for the next GPU session: where tigon.generate's TTFT and decode step go, plus the
# re-measure of Tigon's activation-checkpointing e2e row. Run from the repository root, with the ignored
# wheel folder carried along (the device machine has no network):
#
#     run(command="bash benchmarks/next_gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# Steps, in order, each under its own `timeout`, all inside SESSION_BUDGET_S (default 570 s, under the
# 600 s a device command may run); a step that fails or times out is logged and the next one still runs:
#   0. pip-installs .whl/*.whl (pytest, xdist, liger-kernel, bitsandbytes, ...) into /tmp/site, no network;
#      PYTHONPATH=src:/tmp/site:benchmarks; logs GPU, driver and versions.
#   1. GPU tests of generation, attention (HF attention implementation, decode_attention, rope_kv_write),
#      glu_mlp and qlora: pytest -q -n 8 (~1-2 min).
#   1b. sweep_decode_pdl.py: the decode step with programmatic dependent launch off / on the projections /
#      on the whole chain, and the projections' L2 prefetch budgets; tokens checked equal; TTFT median (~2 min).
#   1c. profile_ttft.py (STEPS must name ttftprof): cProfile of the prefill's host time (~1 min).
#   2. bench_decode --profile: tigon at batch 1 and 8, hf-static-compile at batch 1 as the comparator
#      (~2 min): decode.md gets the TTFT phases per tigon row (device / host ms), the decode-step kernel time
#      by bucket (GEMM, attention, rope_kv_write, norms, GLU, other Triton, other torch), kernels per step,
#      kernel time vs the measured p50 (the gap = launch gaps / idle), GEMM GB/s, and the TTFT kernel profile.
#   3. bench_e2e.py: tigon and liger, without and with activation checkpointing (Tigon's checkpointing row,
#      311.3 ms in results/e2e.md, predates the MLP fix and is re-measured here; ~2-3 min).
# Everything lands in $OUT (8 files, the device returns at most 8): session.log (this script's log and the
# benchmarks' stdout), tests.log, decode.md, decode.json, decode_latency.png (with matplotlib), decode_ops.md,
# e2e.md, e2e.json. Exit status: 0 when every step succeeded, else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-session-out}"
BUDGET="${SESSION_BUDGET_S:-570}"
mkdir -p "$OUT"
LOG="$OUT/session.log"
: >"$LOG"
failed=0
exec 3>&1  # the terminal: log lines go there and to session.log, whatever a step's output is redirected to

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG" >&3; }
left() { echo $(( BUDGET - SECONDS )); }

# STEPS (default "tests pdl decode decode_ops"; e2e is the fifth) picks the steps to run.
STEPS=" ${STEPS:-tests pdl decode decode_ops} "

# step NAME CAP_S CMD...: runs CMD under timeout min(CAP_S, what is left of the budget - RESERVE_S).
step() {
    local name="$1" cap="$2"
    shift 2
    [[ "$STEPS" == *" $name "* ]] || { log "not asked for: $name"; return; }
    local limit
    limit=$(( $(left) - ${RESERVE_S:-0} ))
    (( limit > cap )) && limit=$cap
    if (( limit < 20 )); then
        log "SKIP $name: ${limit} s left in the session budget"
        failed=$((failed + 1))
        return
    fi
    log "START $name (timeout ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if (( rc == 0 )); then
        log "DONE $name"
    else
        log "FAILED $name: exit $rc$( (( rc == 124 || rc == 137 )) && echo ' (timeout)')"
        failed=$((failed + 1))
    fi
}

# 0. Wheels and environment.
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site)
if compgen -G ".whl/*.whl" >/dev/null; then
    if ! "${PIP[@]}" .whl/*.whl >>"$LOG" 2>&1; then  # one wheel refused fails them all: then one by one
        for w in .whl/*.whl; do
            "${PIP[@]}" "$w" >>"$LOG" 2>&1 || log "pip: $w not installed (see above)"
        done
    fi
else
    log "no .whl/*.whl: pass carry=[\".whl\"] to run (pytest-xdist, liger-kernel, bitsandbytes come from there)"
fi
export PYTHONPATH="src:/tmp/site:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
{
    git log -1 --format='commit %H %s' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
} | tee -a "$LOG"

# 1. GPU tests (the reserve keeps room for the two benchmarks whatever the tests do).
RESERVE_S=330 step tests 180 python3 -m pytest -q -n 8 -o cache_dir=/tmp/pytest_cache \
    tests/test_generate.py tests/hf/test_attention_impl.py tests/ops/test_decode_attention.py \
    tests/ops/test_kv_write.py tests/ops/test_glu_mlp.py tests/hf/test_qlora.py tests/hf/test_decode_layer.py \
    tests/ops/test_decode_linear.py tests/ops/test_pdl.py tests/ops/test_decode_qkv_rope.py \
    tests/hf/test_rotary_table.py >"$OUT/tests.log" 2>&1
{ tail -n 3 "$OUT/tests.log"; echo; } | tee -a "$LOG"

# 1b. Launch chaining A/B (PDL off / projections / whole chain, prefetch budgets) and the TTFT median.
step pdl 200 python3 benchmarks/sweep_decode_pdl.py --out "$OUT" >>"$LOG" 2>&1

# 1c. Where the TTFT's host time goes (cProfile of warm prefill-only calls).
step ttftprof 90 python3 benchmarks/profile_ttft.py --top 40 >"$OUT/ttft_host_profile.log" 2>&1

# 2. Decode: TTFT phases and the decode-step profile.
RESERVE_S=160 step decode 240 python3 -m tigon.bench_decode --out "$OUT" --variants tigon,hf-static-compile@1 \
    --batches 1,8 --profile --budget 220 >>"$LOG" 2>&1

# 2b. Decode kernels: decode_linear defaults with and without PDL vs cuBLAS (quick: no launch sweep).
step decode_ops 90 python3 benchmarks/bench_decode_ops.py --out /tmp/decode_ops --quick >>"$LOG" 2>&1
cp /tmp/decode_ops/decode_ops.md "$OUT/" 2>/dev/null  # the JSON stays behind: the device returns at most 8 files

# 3. E2E training step, checkpointing rows re-measured.
step e2e 400 python3 benchmarks/bench_e2e.py --out "$OUT" --variants tigon,liger --with-ckpt \
    --ckpt-variants tigon,liger >>"$LOG" 2>&1

log "finished: $failed failed step(s); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$failed"
