# Paged paths after the per-tile page lookup: GPU tests, then the prefill benchmark twice.
export PYTHONPATH=src
timeout 300 python -m pytest -q -n 8 --dist loadfile -p no:cacheprovider tests/test_decode.py tests/test_paged_varlen.py tests/test_varlen.py tests/test_varlen_sm90.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -2 $OUT/pytest.log
python scripts/feature_bench.py --cases prefill --out $OUT/prefill1.jsonl 2>&1 | tail -3
python scripts/feature_bench.py --cases prefill --out $OUT/prefill2.jsonl 2>&1 | tail -3
python -m flashcore.bench --preset decode --dtype bf16 --providers flashcore,sdpa 2>&1 | tail -14
