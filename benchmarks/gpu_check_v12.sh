#!/usr/bin/env bash
# Ran 2026-11-23 (part 4) on the H100: results/gpu_check_v12 (the pytest step hit its timeout in the W4A8 V4-Pro test, since fixed; see gpu_check_v13a).
# Before: mkdir -p .peers && cp -r ../shared/peers/triton_kernels .peers/ (ignored via .git/info/exclude), then run with carry [".peers"].
# Closing device call of the 2026-11-23 (part 3) session: the CUDA tests fixed after gpu_check_v10/v11 (RoPE /
# swa_append graph check without the scratch row, hc_head checked with the mix bound, hc_post_pre unfused above
# 8 x 4096 elements) and the triton_kernels peer at 1 / 64 / 4096 tokens (V4-Flash, uniform), peer carried in .peers/.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v12}
mkdir -p "$OUT"
timeout 240 python -m pytest -q -p no:cacheprovider -m cuda --tb=short \
  "tests/ops/test_errors.py::test_cuda_rope_and_swa_append_flag_without_sync_and_in_graph" \
  tests/kernels/test_hyper_connection_kernels.py tests/kernels/gemm/test_nvfp4_w4a8.py tests/kernels/test_topk.py \
  tests/kvcache/test_indexer_topk.py 2>&1 | grep -v "^\s*$" | tail -15 | tee "$OUT/gpu_tests.txt"
MEGAMOE_PEERS=$PWD/.peers timeout 110 python benchmarks/bench_peer.py --configs v4-flash --tokens 1,64,4096 \
  --routings uniform --no-bf16 --budget-s 95 --tag peer_flash_1_64_4096 --out-dir "$OUT" 2>&1 | grep -v Warn | tail -8
timeout 120 python benchmarks/bench_topk.py --quick --budget 100 --out "$OUT/topk_v5" 2>&1 | grep -v Warn | tail -30
