#!/usr/bin/env bash
# The benchmark runner for a GPU machine: runs the steps named on the command line, in that order, each under its
# own timeout inside one budget, and leaves at most 8 files in $OUT (a device call returns no more).
#
#     bash benchmarks/run_gpu.sh [STEP ...]          steps: tests ops decode decode-ops e2e
#
#   tests       the README's test command, natively: python -m pytest tests -q -n 8 (tests.log)
#   ops         gpu_check.py without its tests: ceilings and every op benchmark (<gpu>.md, <gpu>.json)
#   decode      bench_decode: tigon at batch 1 and 8 beside HF static cache + compile at batch 1 (decode.md/json)
#   decode-ops  bench_decode_ops --quick: the decode kernels' defaults vs cuBLAS (decode_ops.md)
#   e2e         bench_e2e: the 1.5B training step, tigon beside liger (e2e.md, e2e.json)
#
# DECODE_VARIANTS overrides the decode step's variants. BASELINE=DIR (a tree with src/ and benchmarks/ of another commit) adds, to decode and e2e, the same run of that
# tree in the same call, for side-by-side numbers ("tigon@base" rows). Wheels the image lacks (pytest-xdist,
# liger-kernel, ...) come from .whl/ (../shared/tools/device-wheels.sh; pass carry=[".whl"]).
# Exit status: the number of steps that failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
BUDGET="${BUDGET_S:-570}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
failed=0
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }

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

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
        || log "pip: some wheels were not installed (run.log)"
fi
export PYTHONPATH="src:/tmp/site:benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    git log -1 --format='commit %H %s' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    python3 -c "import torch, triton, transformers, numpy; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" 2>&1
} | tee -a "$LOG"

base=(env PYTHONPATH="${BASELINE:-}/src:/tmp/site:${BASELINE:-}/benchmarks")  # the baseline tree first on the path

for s in "$@"; do
    case "$s" in
        tests) step tests 300 python3 -m pytest tests -q -n 8 -o cache_dir=/tmp/pytest_cache -p no:randomly \
                   >"$OUT/tests.log" 2>&1; tail -n 5 "$OUT/tests.log" | tee -a "$LOG" ;;
        ops) step ops 300 python3 benchmarks/gpu_check.py --no-tests --out "$OUT" --budget 280 >>"$LOG" 2>&1 ;;
        decode)
            step decode 200 python3 benchmarks/bench_decode.py --out "$OUT" \
                --variants "${DECODE_VARIANTS:-tigon,hf-static-compile@1}" --batches 1,8 --budget 190 >>"$LOG" 2>&1
            if [[ -n "${BASELINE:-}" ]]; then
                mkdir -p /tmp/base && step decode-base 150 "${base[@]}" python3 -m tigon.bench_decode --out /tmp/base \
                    --variants tigon --batches 1,8 --budget 140 >>"$LOG" 2>&1
                cp /tmp/base/decode.md "$OUT/decode_base.md" 2>/dev/null
            fi ;;
        decode-ops) step decode-ops 100 python3 benchmarks/bench_decode_ops.py --out /tmp/decode_ops --quick >>"$LOG" 2>&1
            cp /tmp/decode_ops/decode_ops.md "$OUT/" 2>/dev/null ;;
        e2e)
            step e2e 300 python3 benchmarks/bench_e2e.py --out "$OUT" --variants tigon,liger >>"$LOG" 2>&1
            if [[ -n "${BASELINE:-}" ]]; then
                mkdir -p /tmp/base && step e2e-base 150 "${base[@]}" python3 "$BASELINE/benchmarks/bench_e2e.py" \
                    --out /tmp/base --variants tigon >>"$LOG" 2>&1
                cp /tmp/base/e2e.md "$OUT/e2e_base.md" 2>/dev/null
            fi ;;
        *) log "unknown step: $s"; failed=$((failed + 1)) ;;
    esac
done
log "finished: $failed failed step(s); in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$failed"
