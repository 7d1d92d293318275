# GPU check v20 (prepared 2026-11-26, part 10, when no device time was left; not run yet).
#   bash benchmarks/gpu_check_v20.sh tests   -> CUDA tests of what part 10 changed without a GPU: the op validation
#                                              (host-side), the fused decode kernel's row_index mask, the attention
#                                              layer's argument checks, sampling on strided logits
#   bash benchmarks/gpu_check_v20.sh chunks  -> attention v3 KV_CHUNKS = 1 vs 8 (benchmarks/results/attn_v3/run_kv_chunks.sh)
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu_check_v20}
mkdir -p "$OUT"
case "$1" in
tests)
  timeout 300 python -m pytest -q -m cuda tests/ops/test_moe_op_validation.py tests/ops/test_moe_ops.py tests/ops/test_gemm.py \
    tests/ops/test_moe_route_dispatch.py tests/ops/test_sampling.py tests/kernels/test_moe_fused_decode.py \
    tests/layers/test_moe_layer.py 2>&1 | tail -4 | tee "$OUT/a_moe_ops_tests.log"
  timeout 300 python -m pytest -q -m cuda tests/ops/test_attention.py tests/layers/test_attention_layer.py \
    tests/layers/test_attention_layer_errors.py tests/kvcache tests/ops/test_errors.py tests/models/test_v4_model.py \
    2>&1 | tail -4 | tee "$OUT/a_attention_tests.log" ;;
chunks)
  OUT="$OUT" bash benchmarks/results/attn_v3/run_kv_chunks.sh 2>&1 | tee "$OUT/b_kv_chunks.log" ;;
*)
  echo "usage: bash benchmarks/gpu_check_v20.sh tests|chunks" >&2; exit 2 ;;
esac
