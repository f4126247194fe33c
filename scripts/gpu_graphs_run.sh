#!/usr/bin/env bash
# Device-side: the CUDA-graph tests (tests/test_graphs.py, the launch-path tests of
# tests/test_dispatch.py, the bench's --cuda-graph run) and flashcore-bench --cuda-graph on the
# seed and decode presets. Logs and JSON rows under $OUT. About 5-6 minutes on the H100 machine.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"

# pytest-xdist spreads the tests over 4 processes when it is installed.
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 4 --dist load")
timeout 210 python -m pytest -q -p no:cacheprovider $XDIST --durations=15 \
  tests/test_graphs.py tests/test_dispatch.py tests/test_bench.py::test_cuda_graph_run \
  2>&1 | tee "$OUT/pytest_graphs.log" | tail -40
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$OUT/pytest_graphs.log"

timeout 110 python -m flashcore.bench --preset seed --providers flashcore,sdpa \
  --mode fwd,fwdbwd --cuda-graph --out "$OUT/seed_graph.jsonl" 2>&1 | tee "$OUT/bench_seed_graph.log"
echo "bench seed rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench_seed_graph.log"

# flex is left out: torch.compile per cache shape would take most of the time budget.
timeout 110 python -m flashcore.bench --preset decode \
  --providers flashcore-kvcache,flashcore-paged16,flashcore-paged256,sdpa \
  --cuda-graph --out "$OUT/decode_graph.jsonl" 2>&1 | tee "$OUT/bench_decode_graph.log"
echo "bench decode rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench_decode_graph.log"
