#!/usr/bin/env bash
# Device-side: the GPU tests under another Triton than the machine's own, brought by
# scripts/triton_payload.sh (its parts stashed by earlier calls on the same warm machine, the last
# one carried by this call).
#
# Usage (the device's `run`, carry [".triton-3.8.0/part-ab"], after a call that stashed part-aa):
#   [SM90_GATE=1] [TIMING=0] bash scripts/gpu_other_triton.sh 3.8.0 [pytest arguments]
# Default pytest arguments: -m gpu -n 8 tests/test_forward*.py tests/test_decode.py
# tests/test_varlen.py tests/test_varlen_sm90.py. Logs under $OUT (pytest.log). Without SM90_GATE the Gluon tier is off on a
# Triton it was not verified on (ops/runtime.py: SM90_TRITON), so the tests run the portable
# kernels and the tests' own skips, and a one-line timing of the portable forward and backward
# (B 2, H 16, S 4096, D 128, bf16, causal and not) follows. SM90_GATE=1 opens the gate for this
# Triton (scripts/sm90_gate.py: the tests and the auto dispatch then run the Gluon tier too) and
# the timing is scripts/triton_version_ab.py's (the tier beside cuDNN). TIMING=0: no timing.
# DIRECT_GATE=1 (with SM90_GATE=1) opens the direct launches' gate as well (ops/launch.py:
# DIRECT_TRITON; scripts/sm90_gate.py).
cd "$(dirname "$0")/.."
version=${1:?usage: gpu_other_triton.sh VERSION [pytest arguments]}
shift
# shellcheck source=/dev/null
source scripts/triton_payload.sh use "$version" || exit 3
export PYTHONPATH="src:scripts:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, triton.__file__)"
[ $# -gt 0 ] || set -- -m gpu -n 8 tests/test_forward.py tests/test_forward_sm90.py tests/test_forward_sm90_rules.py tests/test_decode.py tests/test_varlen.py tests/test_varlen_sm90.py
gate=()
[ "${SM90_GATE:-0}" = 1 ] && gate=(-p sm90_gate)
timeout "${PYTEST_SECONDS:-420}" python -m pytest -q -p no:cacheprovider "${gate[@]}" "$@" \
    > "$OUT/pytest.log" 2>&1
status=$?
tail -15 "$OUT/pytest.log"
[ "${TIMING:-1}" = 1 ] || exit "$status"
if [ "${SM90_GATE:-0}" = 1 ]; then
    python scripts/triton_version_ab.py
    exit "$status"
fi
python - <<'PY'
import torch, triton
import flashcore
torch.manual_seed(0)
for causal in (False, True):
    q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with flashcore.use_tier("portable"):
        fwd = triton.testing.do_bench(lambda: flashcore.attention(q, k, v, causal=causal))
        o = flashcore.attention(q, k, v, causal=causal)
        do = torch.randn_like(o)
        bwd = triton.testing.do_bench(
            lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    print(f"triton {triton.__version__} portable B2 H16 S4096 D128 bf16 causal={causal}: "
          f"fwd {fwd:.3f} ms, bwd {bwd:.3f} ms")
PY
exit "$status"
