#!/usr/bin/env bash
# Device-side, one call (about 4-6 minutes on an H200): the Hopper forward's causal window masks
# as one comparison (kernels/hopper/common.py: scores). Logs under $OUT. 1. the forward's GPU
# tests with windows (every tier, masks, sinks, varlen); 2. fwd_module_ab.py against the kernel
# modules of another version in BASE (default ab_base/, made before the call where git is, e.g.
# c76003a, the last with the two masks apart: mkdir ab_base && for f in fwd fwd_steps
# fwd_load common; do git show c76003a:src/flashcore/kernels/hopper/$f.py > ab_base/$f.py; done;
# untracked, so it travels with the tree): gpt-oss's (127, 0) window at D = 64 and 128,
# (255, 0), the wide (4095, 0), and a non-causal (256, 256) window as the control.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:scripts PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_forward.py tests/test_forward_sm90.py \
    tests/test_forward_sm90_rules.py tests/test_masks.py \
    tests/test_sinks.py tests/test_varlen.py tests/test_varlen_sm90.py -k "window" > "$OUT/band_fwd_tests.log" 2>&1
status=$?
tail -4 "$OUT/band_fwd_tests.log"
base=${1:-ab_base}
for w in 127,0 255,0 4095,0; do
    python scripts/fwd_module_ab.py "$base" --rounds 5 --window "$w" \
        --cases 64:8192:1,64:16384:1,128:8192:1,128:16384:1 2>&1 | grep -v Warn \
        | tee -a "$OUT/band_fwd_ab.log"
done
python scripts/fwd_module_ab.py "$base" --rounds 5 --window 256,256 --cases 128:8192:0 2>&1 \
    | grep -v Warn | tee -a "$OUT/band_fwd_ab.log"
exit "$status"
