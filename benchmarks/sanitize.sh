#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernel tests (issue 12). Run on the GPU machine from the repository root:
#   bash benchmarks/sanitize.sh [OUT_DIR]      (default: $OUT, else benchmarks/results/sanitize)
#   bash benchmarks/sanitize.sh --dry-run      (CPU: only checks that every selected test id collects)
# Budget: about 8 minutes on an H100 (memcheck ~5, racecheck ~1.5, synccheck ~1.5; each tool has a timeout).
#
# What runs (small-shape CUDA tests, one pytest process per tool):
#   memcheck  : one or more CUDA tests of every kernel family: the NVFP4 GEMMs (Triton tensor-core, CUDA-core
#               gemv, Gluon mma/wgmma, split-K), the device index guard tests (tests/ops/test_errors.py: row_index,
#               inv_perm, topk_ids out of range on every GEMM route), sparse attention (incl. out-of-range indices),
#               top-k (split path, fused with the indexer scores), V4 elementwise, quantize, sampling,
#               hyper-connection, hash routing, the kv-cache kernels (through one V4-Flash CSA attention layer:
#               compressor, flush, indexer, top-k, sparse attention) and the MoE layer (graph + eager); since
#               2026-11-23 (part 3, not yet run): the warp-specialized Gluon kernels (sparse attention v2, grouped
#               GEMM v14 with cp.async and TMA), the fused route + dispatch, hc_post_pre, the top-k rank finish,
#               the W4A8 quantizer / layer and the RoPE / swa_append / kv-cache flags (budget: memcheck ~8 min).
#   racecheck : the shared-memory users (Gluon wgmma / mma GEMM, sparse attention v1 / v2, WS GEMM, top-k,
#               route + dispatch).
#   synccheck : the same subset (barriers).
# Allocator (SANITIZE_ALLOC): "caching" (default) is torch's caching allocator: memcheck sees every access outside
# the cudaMalloc'd segments, not small overruns inside a pooled segment (the kernels' masking tests cover those
# through the error word). "async" (cudaMallocAsync, whose allocations memcheck would track one by one) made the
# Triton launcher's cuPointerGetAttribute fail on pool memory under the sanitizer on the H100 (sanitize_v1: 3
# tests failed, then pytest's failure report read freed device memory); "nocache" cannot capture CUDA graphs.
# SANITIZE_TOOLS picks the tools (default: all three).
# Notes (also in $OUT/README.txt):
#   * Triton/Gluon kernels are ordinary cubins launched with cuLaunchKernel: memcheck sees all their global
#     accesses. The Triton interpreter (TRITON_INTERPRET) is CPU-only and is unset here.
#   * racecheck/synccheck model shared memory and bar.sync barriers only. The Gluon wgmma kernel reads shared
#     memory through asynchronous wgmma ordered by fence.proxy.async + bar.sync; racecheck does not model the
#     async proxy, so a hazard it reports there is advisory (check the addresses against the x_smem buffer).
#     The warp-specialized kernels (sparse_attention_ws, nvfp4_wgmma_ws) synchronise through mbarriers and
#     cp.async / TMA, which racecheck / synccheck do not model either: their reports there are advisory.
#   * Timing/benchmark tests are not selected (the sanitizer slows kernels 10-100x).
# Output: $OUT/summary.txt (per tool: pytest result, sanitizer error count), per-process sanitizer logs
# $OUT/<tool>.<pid>.log, pytest output $OUT/<tool>.pytest.txt, README.txt. Last line printed:
#   SANITIZER SUMMARY: memcheck=<n> racecheck=<n> synccheck=<n> errors; pytest failures: <tools>
# Exit status: 1 if the sanitizer reported any error (or could not finish a tool), 3 if only pytest failed, else 0.
set -u
cd "$(dirname "$0")/.."

MEMCHECK_TESTS=(
  "tests/ops/test_errors.py::test_cuda_guard_graph_replay_equals_eager_and_no_sync"
  "tests/ops/test_errors.py::test_cuda_grouped_mm_all_routes_guard"
  "tests/kernels/gemm/test_nvfp4_gemm.py::test_cuda_sync_free_and_graph_capture"
  "tests/kernels/gemm/test_nvfp4_gemv.py::test_cuda_moe_shapes_and_graph[1]"
  "tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_moe_shapes_sync_free_and_graph[8]"
  "tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_wgmma_sync_free_and_graph"
  "tests/kernels/gemm/test_nvfp4_splitk.py::test_cuda_sync_free_and_graph_replay[8-1024-4096]"
  "tests/ops/test_gemm.py::test_cuda_ops_take_every_route"
  "tests/kernels/test_sparse_attention.py::test_cuda_nan_and_out_of_range"
  "tests/kernels/test_sparse_attention.py::test_cuda_out_of_range_flags_eager_and_graph"
  "tests/kernels/test_sparse_attention.py::test_cuda_v4_flash_shapes[2]"
  "tests/kernels/test_topk.py::test_cuda_graph_replay_and_sync_free[2048]"
  "tests/kernels/test_v4_elementwise.py::test_cuda_exact_designed_inputs_match_cuda_formulas"
  "tests/ops/test_quantize.py::test_cuda_sync_free_and_graph_capture"
  "tests/ops/test_sampling.py::test_cuda_graph_replay_equals_eager_and_sync_free[False]"
  "tests/ops/test_hyper_connection.py::test_hc_pre_fused_matches_reference_cuda"
  "tests/ops/test_moe_hash_routing.py::test_cuda_hash_route_sync_free_and_graph"
  "tests/layers/test_attention_layer.py::test_fused_layer_equals_formulas_cuda_v4_flash[2]"
  "tests/kvcache/test_indexer_topk.py::test_cuda_indexer_topk_graph_and_sync_free[1-32768-1024]"
  "tests/layers/test_moe_layer.py::test_cuda_graph_and_no_host_syncs[2-w4a16]"
  "tests/kernels/test_sparse_attention_ws.py::test_cuda_nan_and_out_of_range_flags"
  "tests/kernels/test_sparse_attention_ws.py::test_cuda_partial_window_inactive_rows_few_entries"
  "tests/kernels/gemm/test_nvfp4_wgmma_ws.py::test_cuda_bad_row_index_is_flagged"
  "tests/kernels/gemm/test_nvfp4_wgmma_ws.py::test_cuda_grouped_matches_float32[counts0-config0-gather]"
  "tests/kernels/gemm/test_nvfp4_wgmma_ws.py::test_cuda_grouped_matches_float32[counts0-config0-tma]"
  "tests/ops/test_moe_route_dispatch.py::test_cuda_fused_route_dispatch_v4_shapes[8-256-4096-6-v4-flash]"
  "tests/kernels/test_hyper_connection_kernels.py::test_cuda_hc_post_pre_fused_equals_unfused_graph_sync_free[4096-1]"
  "tests/kernels/test_topk.py::test_cuda_split_rank_finish_v4_shapes[1024-1-32768]"
  "tests/kernels/gemm/test_nvfp4_w4a8.py::test_cuda_quantizer_bit_exact_large"
  "tests/layers/test_moe_w4a8.py::test_cuda_w4a8_graph_and_no_host_syncs[v4-flash-8]"
  "tests/ops/test_errors.py::test_cuda_kvcache_kernels_flag_without_sync_and_in_graph"
  "tests/ops/test_errors.py::test_cuda_rope_and_swa_append_flag_without_sync_and_in_graph"
)
SUBSET_TESTS=(
  "tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_wgmma_sync_free_and_graph"
  "tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_moe_shapes_sync_free_and_graph[8]"
  "tests/kernels/test_sparse_attention.py::test_cuda_nan_and_out_of_range"
  "tests/kernels/test_topk.py::test_cuda_graph_replay_and_sync_free[2048]"
  "tests/kernels/test_sparse_attention_ws.py::test_cuda_partial_window_inactive_rows_few_entries"
  "tests/kernels/gemm/test_nvfp4_wgmma_ws.py::test_cuda_grouped_matches_float32[counts0-config0-gather]"
  "tests/ops/test_moe_route_dispatch.py::test_cuda_fused_route_dispatch_v4_shapes[8-256-4096-6-v4-flash]"
)
TIMEOUT_MEMCHECK=${TIMEOUT_MEMCHECK:-480}
TIMEOUT_RACECHECK=${TIMEOUT_RACECHECK:-100}
TIMEOUT_SYNCCHECK=${TIMEOUT_SYNCCHECK:-80}

if [ "${1:-}" = "--dry-run" ]; then  # collection only (CPU is fine): every id must exist
  ids=("${MEMCHECK_TESTS[@]}" "${SUBSET_TESTS[@]}")
  out=$(python -m pytest --collect-only -q -p no:cacheprovider "${ids[@]}" 2>&1)
  rc=$?
  n=$(printf '%s\n' "$out" | grep -c '::')
  printf '%s\n' "$out" | tail -3
  echo "dry run: $n tests collected from ${#ids[@]} ids (rc=$rc)"
  [ $rc -eq 0 ] && exit 0 || exit 1  # pytest exits 4 when an id does not exist
fi

OUT=${1:-${OUT:-benchmarks/results/sanitize}}
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.pytest.txt "$OUT/summary.txt"
unset TRITON_INTERPRET
case "${SANITIZE_ALLOC:-caching}" in
  nocache) export PYTORCH_NO_CUDA_MEMORY_CACHING=1 ;;
  async) export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync ;;
  *) ;;  # torch's caching allocator: memcheck sees accesses outside every cudaMalloc'd segment
esac
# short tracebacks: a long one makes pytest repr the failing test's tensors (device reads after a failure)
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --tb=short"
export CUDA_LAUNCH_BLOCKING=0 MEGAMOE_DEVICE_GUARD=1
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$CS" ]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee "$OUT/README.txt"
  echo "SANITIZER SUMMARY: not run"; exit 2
fi
{
  echo "compute-sanitizer: $CS ($($CS --version | tail -1))"
  date -u
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  echo "allocator: PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-} PYTORCH_NO_CUDA_MEMORY_CACHING=${PYTORCH_NO_CUDA_MEMORY_CACHING:-}"
  sed -n '2,31p' "$0"
} > "$OUT/README.txt"

declare -A ERRS
PYFAIL=""
SANFAIL=0
run() {  # tool timeout test-ids...
  local tool=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $tool (${#@} test ids, timeout ${limit}s)" | tee -a "$OUT/summary.txt"
  timeout --signal=TERM --kill-after=20 "$limit" \
    "$CS" --tool "$tool" --target-processes all --print-limit 100 --log-file "$OUT/$tool.%p.log" \
      python -m pytest -q -p no:cacheprovider "$@" > "$OUT/$tool.pytest.txt" 2>&1
  local rc=$?
  # every process writes "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY: N hazards ...")
  local n
  n=$(cat "$OUT/$tool".*.log 2>/dev/null | grep -oE '(ERROR SUMMARY|RACECHECK SUMMARY): [0-9]+' \
        | awk '{s += $NF} END {print s + 0}')
  local seen
  seen=$(cat "$OUT/$tool".*.log 2>/dev/null | grep -cE '(ERROR|RACECHECK) SUMMARY')
  ERRS[$tool]=$n
  local last
  last=$(tail -1 "$OUT/$tool.pytest.txt")
  echo "   rc=$rc, $((SECONDS - start))s, sanitizer errors: $n (summaries from $seen processes); pytest: $last" \
    | tee -a "$OUT/summary.txt"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || [ "$seen" -eq 0 ]; then
    echo "   $tool did not finish (timeout or no sanitizer summary)" | tee -a "$OUT/summary.txt"; SANFAIL=1
  fi
  [ "$n" -gt 0 ] && SANFAIL=1
  case "$last" in *failed*|*error*) PYFAIL="$PYFAIL $tool";; esac
}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
for tool in $TOOLS; do
  case $tool in
    memcheck) run memcheck "$TIMEOUT_MEMCHECK" "${MEMCHECK_TESTS[@]}" ;;
    racecheck) run racecheck "$TIMEOUT_RACECHECK" "${SUBSET_TESTS[@]}" ;;
    synccheck) run synccheck "$TIMEOUT_SYNCCHECK" "${SUBSET_TESTS[@]}" ;;
  esac
done
line="SANITIZER SUMMARY: memcheck=${ERRS[memcheck]:-not run} racecheck=${ERRS[racecheck]:-not run} synccheck=${ERRS[synccheck]:-not run} errors; pytest failures:${PYFAIL:- none}"
echo "$line" | tee -a "$OUT/summary.txt"
echo "logs: $OUT"
if [ $SANFAIL -ne 0 ]; then exit 1; fi
if [ -n "$PYFAIL" ]; then exit 3; fi
exit 0
