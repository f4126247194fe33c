# One device call for the Hopper forward's MLA build (D=192, Dv=128; ops/fwd_sm90.py:
# MLA_HEAD_DIMS), from the repository root on the GPU machine, logs under $OUT: its GPU tests (the
# kernel launched directly, fp16 and bf16, and the API path), then two runs of the MLA timings:
# the tier forced and "auto" (the same kernel at the script's 4096 and 8192) beside SDPA (the
# backward stays portable at these head dims).
#
#     bash scripts/gpu_mla_run.sh
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=src
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_value_dim.py -k sm90 \
    > $OUT/mla_test.log 2>&1
echo "test rc=$?"; tail -15 $OUT/mla_test.log
for run in 1 2; do
    timeout 200 python scripts/feature_bench.py --cases mla --mla-sm90 > $OUT/mla_bench$run.log 2>&1
    echo "bench $run rc=$?"; cat $OUT/mla_bench$run.log
done
