#!/usr/bin/env bash
# Device-side: the GPU test tier (and the interpreter tier's cases, compiled) with a log under $OUT.
# FUZZ_SECONDS=N: then N seconds of scripts/gpu_fuzz.py (random problems on both tiers, both
# kinds; a new seed each run unless FUZZ_SEED is given), its log under $OUT too.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -m pytest -q -x -n 4 "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
status=$?
if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then
    seed=${FUZZ_SEED:-$(date +%s)}
    python scripts/gpu_fuzz.py --seconds "$FUZZ_SECONDS" --seed "$seed" > "$OUT/fuzz.log" 2>&1
    fuzz=$?
    echo "gpu_fuzz.py, seed $seed: $(tail -1 "$OUT/fuzz.log")"
    grep -v " -> ok" "$OUT/fuzz.log" | head -20
    [ "$status" -eq 0 ] && status=$fuzz
fi
exit "$status"
