#!/usr/bin/env bash
# FlashCore's kernels under compute-sanitizer: memcheck (with --leak-check full), racecheck,
# initcheck and synccheck, each over scripts/sanitize_cases.py (small shapes, forward and, once
# registered, backward; results checked against the reference). Prints one summary line per tool
# and exits non-zero when any tool reports an error or a result is wrong.
#
# Usage:   scripts/sanitize.sh [TOOL ...]          default: memcheck racecheck initcheck synccheck
# Env:     SANITIZE_LOG_DIR   where the full logs go (default: out/sanitize)
#          SANITIZE_ARGS      extra arguments for the driver, e.g. "--dtypes fp16 --no-backward"
#          SANITIZE_KERNELS   only check kernels whose name matches, as compute-sanitizer
#                             --kernel-name takes it: key=value, e.g. "kns=attn" (a substring)
#          COMPUTE_SANITIZER  the binary (default: on PATH, else /usr/local/cuda/bin)
#
# memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1: with PyTorch's caching
# allocator an out-of-bounds access usually lands inside another cached block and goes unseen,
# and initcheck cannot tell a fresh tensor from a recycled one.
set -uo pipefail
cd "$(dirname "$0")/.."

sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$sanitizer" ]; then
    echo "sanitize.sh: compute-sanitizer not found; set COMPUTE_SANITIZER" >&2
    exit 2
fi
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
logdir=${SANITIZE_LOG_DIR:-out/sanitize}
mkdir -p "$logdir"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
read -r -a driver_args <<<"${SANITIZE_ARGS:-}"
driver=(python scripts/sanitize_cases.py "${driver_args[@]}")

# Once without the sanitizer: the results must be right, and every kernel variant gets compiled
# into Triton's cache, so the sanitized runs below only launch.
if ! "${driver[@]}" >"$logdir/plain.log" 2>&1; then
    echo "sanitize.sh: the driver fails without the sanitizer; see $logdir/plain.log" >&2
    tail -n 20 "$logdir/plain.log" >&2
    exit 1
fi
"$sanitizer" --version | tail -n 1

status=0
printf '%-10s %-5s %-7s %s\n' tool exit errors summary
for tool in "${tools[@]}"; do
    opts=(--tool "$tool" --error-exitcode 86 --show-backtrace device)
    [ -n "${SANITIZE_KERNELS:-}" ] && opts+=(--kernel-name "$SANITIZE_KERNELS")
    no_cache=0
    tool_args=()
    limit=100
    case "$tool" in
        memcheck) opts+=(--leak-check full); no_cache=1 ;;
        # initcheck does not see stores made by the bulk-copy engine (TMA): every read of an
        # output the forward wrote through a tensor descriptor is reported as uninitialised
        # (H100, compute-sanitizer 2025.3.1: 3200 reports for a 200x2x64 bf16 output, 0 with
        # pointer stores). It checks the pointer path; memcheck and racecheck cover the TMA one.
        initcheck) no_cache=1; tool_args=(--no-tma) ;;
        # Every report displayed, one per hazard, for scripts/racecheck_triage.py (below).
        racecheck) opts+=(--racecheck-report hazard); limit=0 ;;
        synccheck) ;;
        *) echo "sanitize.sh: unknown tool '$tool'" >&2; exit 2 ;;
    esac
    opts+=(--print-limit "$limit")
    log="$logdir/$tool.log"
    (
        [ "$no_cache" = 1 ] && export PYTORCH_NO_CUDA_MEMORY_CACHING=1
        "$sanitizer" "${opts[@]}" "${driver[@]}" "${tool_args[@]}"
    ) >"$log" 2>&1
    rc=$?
    # "ERROR SUMMARY: N errors" (memcheck, initcheck, synccheck); racecheck prints only
    # "RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)" (compute-sanitizer
    # 2025.3.1). A missing summary means the run died early: count it as an error.
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | tail -n 1 | grep -oE '[0-9]+$')
    if [ -z "$errors" ] && [ "$tool" = racecheck ]; then
        errors=$(grep -oE 'RACECHECK SUMMARY: .*\(([0-9]+) errors' "$log" | tail -n 1 |
            grep -oE '[0-9]+ errors' | grep -oE '[0-9]+')
    fi
    summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY' "$log" | sed 's/^=* *//' | paste -sd ';' - | sed 's/;/; /g')
    cases=$(grep -E '^sanitize_cases:' "$log" | tail -n 1)
    if [ "$tool" = racecheck ]; then
        # racecheck reports the partition state of every warp-specialized Gluon kernel (a
        # barrier orders those accesses) and data handed between partitions through mbarriers
        # alone (scripts/racecheck_triage.py says why): the run is clean when the driver's
        # results are right and every report is one of those.
        triage=$(python scripts/racecheck_triage.py "$log")
        triage_rc=$?
        summary="${summary:-}; ${triage#racecheck_triage: }"
        if [ "$triage_rc" -ne 0 ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 86 ]; } || [ -z "$cases" ]; then
            status=1
        fi
    elif [ "$rc" -ne 0 ] || [ -z "$errors" ] || [ "$errors" -ne 0 ]; then
        status=1
    fi
    printf '%-10s %-5s %-7s %s\n' "$tool" "$rc" "${errors:-?}" "${summary:-no summary (see $log)}; ${cases:-driver did not finish}"
done
if [ "$status" -ne 0 ]; then
    echo "sanitize.sh: errors found; logs in $logdir/ (exit 86 = sanitizer error, 1 = wrong result)"
else
    echo "sanitize.sh: clean; logs in $logdir/"
fi
exit "$status"
