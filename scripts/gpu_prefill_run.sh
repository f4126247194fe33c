# GPU tests of the paged/prefill paths and the forward kernel, then the prefill benchmark twice.
export PYTHONPATH=src
timeout 400 python -m pytest -q -n 8 --dist loadfile -p no:cacheprovider tests/test_decode.py tests/test_paged_varlen.py tests/test_varlen.py tests/test_varlen_sm90.py tests/test_forward.py tests/test_sinks.py tests/test_value_dim.py tests/test_masks.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -4 $OUT/pytest.log
python scripts/feature_bench.py --cases prefill --out $OUT/prefill1.jsonl 2>&1 | tail -3
python scripts/feature_bench.py --cases prefill --out $OUT/prefill2.jsonl 2>&1 | tail -3
