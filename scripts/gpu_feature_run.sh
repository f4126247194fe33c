set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=src
timeout 420 python -m pytest -q -n 8 --dist loadfile -p no:cacheprovider tests/test_sinks.py tests/test_value_dim.py tests/test_forward.py tests/test_forward_sm90.py tests/test_forward_sm90_rules.py tests/test_backward.py tests/test_backward_sm90.py tests/test_backward_d256.py tests/test_decode.py tests/test_varlen.py tests/test_varlen_sm90.py tests/test_masks.py tests/test_sdpa.py tests/test_compile.py --deselect tests/test_sdpa.py::test_sdpa_bad_arguments > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -15 $OUT/pytest.log
python scripts/feature_bench.py --out $OUT/feat1.jsonl 2>&1 | tail -20
python scripts/feature_bench.py --out $OUT/feat2.jsonl 2>&1 | tail -12
