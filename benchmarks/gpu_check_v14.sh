#!/usr/bin/env bash
# NOT RUN yet (the 2026-11-23 part-4 session's device time ran out): run it first next session (peer not needed).
# 1. PDL (issue 11): CUDA test (PDL == plain bits, graph == eager, sync-free) and the layer A/B at 1 / 8 tokens.
# 2. V4-Pro MoE layer at 1 / 8 tokens in its own process (bench_moe ran out of memory after V4-Flash in one).
# 3. WS v14 LARGE config / sweep at V4-Flash gate_up (issue 10; never timed).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v14}
mkdir -p "$OUT"
timeout 400 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/kernels/test_pdl.py 2>&1 \
  | grep -v "^\s*$" | tail -8 | tee "$OUT/gpu_tests.txt"
# PDL on every decode-path family now (MoE layer, split top-k, sparse attention, tiny decode step): ~2-3 min
timeout 300 python benchmarks/bench_pdl.py --tokens 1,8 --out "$OUT/pdl_v2" 2>&1 \
  | grep -v Warn | tail -14
timeout 120 python benchmarks/bench_moe.py --configs v4-pro --tokens 1,8 --out-dir "$OUT" --tag moe_v8_pro 2>&1 \
  | grep -v Warn | tail -6
timeout 120 python benchmarks/validate_wgmma_ws.py --only flash-gate_up --time --sweep --out "$OUT/ws_sweep.json" 2>&1 \
  | grep -v Warn | tail -20
