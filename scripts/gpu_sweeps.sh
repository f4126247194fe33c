#!/usr/bin/env bash
# Device-side: the FA sweep beside cuDNN and FlashAttention-4, twice a dtype, with each run's rows
# under $OUT and FlashCore's geometric means against each provider printed (flashcore-bench
# --summarize); then, with HOST=1, the seed preset (forward, forward + backward) and the decode
# preset under CUDA graphs, twice each. On a warm H100 with Triton's cache filled: about 40 s a
# forward run and 60 s a backward one.
#   bash scripts/gpu_sweeps.sh fwd bf16 fp16      # modes: fwd, bwd (one a call); dtypes after it
#   HOST=1 bash scripts/gpu_sweeps.sh none
# FA4 where it imports (`source .peers/b/fa4-env.sh install` first; docs/benchmarks.md): without
# it the fa4 rows are refused with the reason and the rest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
mode=${1:?usage: gpu_sweeps.sh fwd|bwd|none DTYPE...}
shift
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
status=0
if [ "$mode" != none ]; then
    for dtype in "$@"; do
        for run in 1 2; do
            rows="$OUT/sweep-$mode-$dtype-$run.jsonl"
            python -m flashcore.bench --preset sweep --mode "$mode" --dtype "$dtype" \
                --providers flashcore,sdpa-cudnn,fa4 --out "$rows" > "${rows%.jsonl}.txt" 2>&1
            rc=$?
            echo "sweep $mode $dtype run $run: rc $rc, $(tail -1 "${rows%.jsonl}.txt")"
            [ "$rc" -eq 0 ] || status=$rc
            if [ "$rc" -eq 0 ] && [ -s "$rows" ]; then
                grep -h "matmul peak" "${rows%.jsonl}.txt"
                python -m flashcore.bench --summarize "$rows" | tail -n +3
            fi
        done
    done
fi
if [ "${HOST:-0}" = 1 ]; then
    for run in 1 2; do
        python -m flashcore.bench --preset seed --providers flashcore,sdpa,sdpa-cudnn \
            --mode fwd,fwdbwd --cuda-graph --out "$OUT/seed-$run.jsonl" > "$OUT/seed-$run.txt" 2>&1
        echo "seed run $run: rc $?, $(tail -1 "$OUT/seed-$run.txt")"
        python -m flashcore.bench --preset decode --cuda-graph --out "$OUT/decode-$run.jsonl" \
            > "$OUT/decode-$run.txt" 2>&1
        echo "decode run $run: rc $?, $(tail -1 "$OUT/decode-$run.txt")"
    done
fi
exit $status
