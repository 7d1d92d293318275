#!/usr/bin/env bash
# Device call for the merged skewed-routing, reliability and dense split-K work (session of 2026-11-23, part 2):
# their CUDA tests, the guard-cost benchmark, the skewed-routing layer benchmark (V4-Flash) and the decode
# regression check. Logs and result files go to $OUT (default /tmp/megamoe-gpu-check-v5).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v5}
mkdir -p "$OUT"
status=0
timeout 240 python -m pytest -q -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py tests/ops/test_gemm.py \
  tests/ops/test_errors.py tests/kernels/test_sparse_attention.py tests/kernels/test_nvfp4_gluon.py \
  tests/layers/test_moe_layer.py tests/layers/test_attention_layer_errors.py tests/models/test_model_errors.py \
  2>&1 | tail -25 | tee "$OUT/gpu_tests_v5.txt" || status=1
timeout 150 python benchmarks/bench_guard.py --out-dir "$OUT" 2>&1 | tail -15 || status=1
timeout 200 python benchmarks/bench_moe_skew.py --configs v4-flash --out-dir "$OUT" 2>&1 | tail -20 || status=1
timeout 100 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,64 --tag moe_skew_v1_decode \
  --out-dir "$OUT" 2>&1 | tail -12 || status=1
echo "gpu_check_v5 status: $status"
exit $status
