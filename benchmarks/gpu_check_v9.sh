#!/usr/bin/env bash
# Third device call of the 2026-11-23 (part 3) session: CUDA tests of the merged W4A8 mode, hyper-connections v2,
# RoPE / swa_append flags, the warp-specialized kernels (pytest) and the model step (graph == eager, sync-free);
# then the W4A8 vs W4A16 GEMM comparison (issue 13) and the hyper-connection microbenchmark. Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v9}
mkdir -p "$OUT"
timeout 210 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/kernels/gemm/test_nvfp4_w4a8.py \
  tests/layers/test_moe_w4a8.py tests/ops/test_errors.py tests/kernels/test_hyper_connection_kernels.py \
  tests/kernels/test_sparse_attention_ws.py tests/kernels/gemm/test_nvfp4_wgmma_ws.py tests/models/test_v4_model.py \
  -k "not tiny_model" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 170 python benchmarks/bench_gemm.py --w4a8 --out-dir "$OUT" --tag gemm_w4a8_v1 2>&1 | grep -v Warn | tail -12
timeout 60 python benchmarks/bench_hyper_connection.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/hyper_connection_v2.md"
