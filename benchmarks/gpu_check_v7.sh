#!/usr/bin/env bash
# First device call of the 2026-11-23 (part 3) session: CUDA tests of the fused decode route + dispatch and the
# issue-12 flags / refactored CUDA tests still unverified; first GPU runs of the two Gluon warp-specialized kernels
# (grouped GEMM, sparse attention) through their subprocess-with-timeout validators (a hang costs one case only).
# Logs go to $OUT (default /tmp/megamoe-gpu-check-v7).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v7}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 170 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/ops/test_moe_route_dispatch.py \
  tests/layers/test_moe_layer.py tests/layers/test_moe_hash_layer.py tests/ops/test_errors.py \
  tests/ops/test_moe_hash_routing.py tests/kernels/test_hyper_connection_kernels.py tests/ops/test_gemm_bands.py \
  2>&1 | tail -25 | tee "$OUT/gpu_tests_a.txt"
timeout 60 python benchmarks/bench_route.py --tokens 1,8,64 --out "$OUT/route_v1.md" 2>&1 | tail -12
timeout 150 python benchmarks/validate_wgmma_ws.py --quick --timeout 45 --out "$OUT/wgmma_ws_quick.json" 2>&1 | tail -14
timeout 150 python benchmarks/validate_attention_ws.py --quick --no-timing --timeout 45 --out "$OUT/attention_v2_check" 2>&1 | tail -16
