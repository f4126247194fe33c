# One device call for the Hopper forward's wider head dims, from the repository root on the GPU
# machine, logs under $OUT:
# - MLA (Q/K 192, V 128; ops/fwd_sm90.py: MLA_HEAD_DIMS, enabled): its GPU tests (the kernel
#   launched directly, and the API path), then two runs of its timings (the tier forced and
#   "auto", the same kernel at the script's 4096 and 8192, beside SDPA; the backward stays
#   portable at these head dims);
# - head dim 256 (WIDE_HEAD_DIMS, on since its GPU test passed: WIDE_VERIFIED): its GPU test
#   (the kernel launched directly), then its timings against the portable forward and cuDNN
#   (flat schedule).
#
#     bash scripts/gpu_hopper_dims_run.sh
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=src
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_value_dim.py -k sm90 \
    tests/test_forward_sm90.py::test_forward_gpu_sm90_kernel_d256 > $OUT/dims_test.log 2>&1
echo "tests rc=$?"; tail -15 $OUT/dims_test.log
for run in 1 2; do
    timeout 120 python scripts/feature_bench.py --cases mla --mla-sm90 > $OUT/mla_bench$run.log 2>&1
    echo "mla bench $run rc=$?"; cat $OUT/mla_bench$run.log
done
timeout 200 python scripts/hopper_fwd.py bench --head-dims 256 --schedules flat --dtypes bf16 \
    --seqlens 1024 4096 16384 --runs 2 > $OUT/d256_bench.log 2>&1
echo "d256 bench rc=$?"; grep -v Warn $OUT/d256_bench.log | tail -14
