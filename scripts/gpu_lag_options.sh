#!/usr/bin/env bash
# Device-side, one call (about 4-6 minutes on an H200): softcap and causal ALiBi at D = 128 with
# each step's dQ a step late (ops/bwd_sm90.DQ_LAG_OPTIONS, on; the A/B flips it). Logs under
# $OUT. 1. its GPU tests (off against on: dK and dV bit for bit, the FA rule; packed batches);
# 2. scripts/bwd_switch_ab.py DQ_LAG_OPTIONS twice (causal softcap and ALiBi at 2048 and 8192,
# causal windows with softcap or ALiBi; the D = 64 case of windowoptions is a control).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:scripts PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_backward.py tests/test_backward_sm90.py \
    tests/test_varlen.py tests/test_varlen_sm90.py \
    -k "lag" > "$OUT/lag_tests.log" 2>&1
status=$?
tail -4 "$OUT/lag_tests.log"
for run in 1 2; do
    echo "== run $run" | tee -a "$OUT/lag_ab.log"
    python scripts/bwd_switch_ab.py DQ_LAG_OPTIONS --rounds 5 --cases softcap,alibi,windowoptions \
        2>&1 | grep -v Warn | tee -a "$OUT/lag_ab.log"
done
exit "$status"
