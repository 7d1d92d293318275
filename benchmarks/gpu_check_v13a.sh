#!/usr/bin/env bash
# First device call of the 2026-11-23 part-4 session (issues 11 / 12): the CUDA tests fixed after gpu_check_v12
# (WS route at 300 rows/expert, V4-dims hc mix bound, W4A8 V4 shapes from random codes), memcheck over the kernel
# tests (clean pytest this time), racecheck of the WS GEMM's flat variant (same smem tiles, bar.sync only: the
# mbarrier-ordered WS reports of sanitize_v3 are outside racecheck's model), and the MoE layer at 1 / 8 / 64
# tokens for V4-Flash and V4-Pro (issue 11's table).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v13a}
mkdir -p "$OUT"
timeout 200 python -m pytest -v -p no:cacheprovider -m cuda --tb=short tests/ops/test_gemm.py::test_cuda_ops_take_every_route \
  tests/kernels/test_hyper_connection_kernels.py tests/kernels/gemm/test_nvfp4_w4a8.py --durations=4 2>&1 \
  | grep -E "PASS|FAIL|ERROR|^E |passed|failed|s call" | tail -30 | tee "$OUT/gpu_tests.txt"
SANITIZE_TOOLS=memcheck timeout 200 bash benchmarks/sanitize.sh "$OUT/sanitize_memcheck" 2>&1 | tail -3
MEGAMOE_WGMMA_WS_FLAT=1 SANITIZE_TOOLS=racecheck timeout 100 bash benchmarks/sanitize.sh "$OUT/sanitize_race_flat" 2>&1 | tail -3
grep -hE "Race reported|RACECHECK SUMMARY" "$OUT"/sanitize_race_flat/racecheck.*.log | sort | uniq -c | head -8
timeout 170 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 1,8,64 --out-dir "$OUT" --tag moe_v8 2>&1 \
  | grep -v Warn | tail -14
