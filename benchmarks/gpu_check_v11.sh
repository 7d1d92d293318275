#!/usr/bin/env bash
# Last device call of the 2026-11-23 (part 3) session: the output of the CUDA tests that failed in gpu_check_v10
# (RoPE / swa_append flags, hyper-connections at 64 tokens) and the triton_kernels peer, carried in .peers/
# (the ../shared folder does not travel with device runs).
set -o pipefail
export PYTHONUNBUFFERED=1
timeout 75 python -m pytest -q -p no:cacheprovider -m cuda --tb=short \
  "tests/ops/test_errors.py::test_cuda_rope_and_swa_append_flag_without_sync_and_in_graph" \
  "tests/kernels/test_hyper_connection_kernels.py::test_cuda_v4_flash_dims_match_reference[64]" \
  "tests/kernels/test_hyper_connection_kernels.py::test_cuda_hc_post_pre_fused_equals_unfused_graph_sync_free[4096-64]" \
  2>&1 | grep -v "^\s*$" | grep -E "^E |Error|assert|FAILED|passed|failed|test_.*py:[0-9]+" | head -60 | tee "$OUT/failing_tests.txt"
MEGAMOE_PEERS=$PWD/.peers timeout 170 python benchmarks/bench_peer.py --quick --budget-s 140 --tag peer_quick --out-dir "$OUT" 2>&1 | grep -v Warn | tail -14
