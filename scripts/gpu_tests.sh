#!/usr/bin/env bash
# Device-side: the GPU test tier (and the interpreter tier's cases, compiled) with a log under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -m pytest -q -x -n 4 "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
