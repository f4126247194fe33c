# One device call's worth of the Hopper forward's open checks (run from the repository root on the
# GPU machine; logs under $OUT): the HAS_SINKS build's numerics (the check script's sink cases on
# every schedule and three consumers, and its GPU test), then clock traces of the two-consumer
# D=128 and three-consumer D=64 kernels.
#
#     bash scripts/gpu_hopper_fwd_run.sh
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=src
C3F=c3f:64:3,128,3,160,128,1,0
C3P=c3p:64:3,128,3,160,128,1,1
# One dtype per call of the check (both in one took more than 300 s on the H100).
for dt in bf16 fp16; do
    timeout 280 python scripts/hopper_fwd.py check --dtypes $dt --variant $C3F --variant $C3P \
        > $OUT/check_$dt.log 2>&1
    echo "check $dt rc=$?"; grep -cE "^ok" $OUT/check_$dt.log; grep -E "FAIL|failures" $OUT/check_$dt.log | tail -8
done
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_sinks.py -k sm90_forward \
    > $OUT/sinks.log 2>&1
echo "sinks rc=$?"; tail -3 $OUT/sinks.log
timeout 60 python scripts/hopper_fwd_trace.py --seqlen 8192 --head-dim 128 > $OUT/trace128.log 2>&1
cat $OUT/trace128.log
timeout 60 python scripts/hopper_fwd_trace.py --seqlen 8192 --head-dim 64 --three \
    > $OUT/trace64.log 2>&1
cat $OUT/trace64.log
