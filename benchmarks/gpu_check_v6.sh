#!/usr/bin/env bash
# Final device call of the 2026-11-23 (part 2) session: CUDA tests of the fused hyper-connection, decode glue,
# top-k v3 and model code; the decode-step profile and generate after them; memcheck with the caching allocator.
# Logs go to $OUT (default /tmp/megamoe-gpu-check-v6).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v6}
mkdir -p "$OUT"
timeout 200 python -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_hyper_connection_kernels.py \
  tests/ops/test_hyper_connection.py tests/kvcache/test_decode_glue.py tests/kvcache/test_indexer_topk.py \
  tests/models tests/layers/test_attention_layer.py tests/layers/test_attention_simulation.py \
  ${EXTRA_TESTS:-} 2>&1 | tail -30 | tee "$OUT/gpu_tests_v6.txt"
timeout 80 python benchmarks/profile_decode_step.py --layers 4 --batch 1,64 --out "$OUT" 2>&1 | grep -v Warn | head -40
timeout 90 python -m megamoe generate --batch 1,8,64 --steps 16 2>&1 | tail -12 | tee "$OUT/generate.txt"
SANITIZE_TOOLS=memcheck TIMEOUT_MEMCHECK=150 bash benchmarks/sanitize.sh "$OUT/sanitize" 2>&1 | tail -4
