#!/usr/bin/env bash
# Second device call of the 2026-11-23 (part 3) session: the issue-9 GPU token tests against the kernel-mirroring
# (bf16-P) reference; timing of the two Gluon warp-specialized kernels validated in gpu_check_v7 (sparse attention
# v2 at batch 32/128 x 32k/128k; grouped GEMM at E=256 V4-Flash shapes). Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v8}
mkdir -p "$OUT"
timeout 170 python -m pytest -q -p no:cacheprovider -m cuda --tb=short -rxX tests/models/test_v4_model.py -k cuda \
  2>&1 | tail -30 | tee "$OUT/gpu_tests_model.txt"
timeout 200 python benchmarks/validate_attention_ws.py --no-check --batches 1,32,128 --contexts 32768,131072 \
  --timeout 45 --out "$OUT/attention_v2" 2>&1 | tail -16
timeout 200 python benchmarks/validate_wgmma_ws.py --experts 256 --only flash --time --timeout 45 \
  --out "$OUT/wgmma_ws_v14_flash.json" 2>&1 | tail -14
