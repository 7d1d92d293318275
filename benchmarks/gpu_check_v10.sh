#!/usr/bin/env bash
# Fourth device call of the 2026-11-23 (part 3) session: CUDA tests of the merged work (fused route+dispatch v2,
# flags, hc v2, WS attention / GEMM, top-k v4, model step, W4A8 layer), then the measurements: route+dispatch v2,
# hyper-connections v2, top-k v4 (issue grid), the triton_kernels peer (quick), generate at batch 1 / 8 / 64.
# Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v10}
mkdir -p "$OUT"
timeout 220 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/models/test_v4_model.py \
  tests/ops/test_moe_route_dispatch.py tests/ops/test_errors.py tests/kernels/test_hyper_connection_kernels.py tests/kernels/test_sparse_attention_ws.py \
  tests/kernels/gemm/test_nvfp4_wgmma_ws.py tests/kvcache/test_indexer_topk.py tests/kernels/test_topk.py \
  tests/layers/test_moe_w4a8.py 2>&1 | tail -22 | tee "$OUT/gpu_tests.txt"
timeout 45 python benchmarks/bench_route.py --tokens 1,2,4,8,16,64 --out "$OUT/route_v2.md" 2>&1 | grep -v Warn | tail -14
timeout 40 python benchmarks/bench_hyper_connection.py 2>&1 | grep -v Warn | tail -8 | tee "$OUT/hyper_connection_v2.md"
timeout 80 python benchmarks/bench_topk.py --quick --budget 65 --out "$OUT/topk_v4" 2>&1 | grep -v Warn | tail -30
timeout 110 python benchmarks/bench_peer.py --quick --budget-s 90 --tag peer_quick --out-dir "$OUT" 2>&1 | grep -v Warn | tail -12
timeout 85 python -m megamoe generate --batch 1,8,64 --steps 16 2>&1 | tail -12 | tee "$OUT/generate.txt"
