#!/usr/bin/env bash
# 2026-11-25. One H100, under 3 minutes. `bash benchmarks/gpu_v18_fused_proj.sh` (logs to "$OUT").
# The attention block's fused projections (NOTES_attention.md, "Fused projections"): x -> wq_a | wkv, qr -> wq_b |
# indexer.wq_b, x.float() -> compressor (+ indexer compressor) wkv | wgate, outputs split as column views read in place
# by the strided-row rms_norm / q_kv / index_q / compressor-step kernels.
#   1. decode-step profile, 4 layers (window, window, CSA, HCA), batch 1 and 64: kernels per step and GPU time, to set
#      against results/gpu_check_v18/profile.log (same script before the change: 111 / 189 kernels per step,
#      _splitk_partial_kernel 17 x 8.16 us and gemvx 6 x 6.09 us at batch 1). Expected: 9 kernels fewer per step
#      (NVFP4 split-K 17 -> 12, float32 compressor GEMMs 6 -> 2, plus their cuBLAS split-K reduces at batch 64).
#   2. CUDA tests touching the attention layer, the strided-row kernels and the decode graph (tests_*.log)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-v18-fused-proj}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/device.txt"

# profile first (its Triton builds warm the cache the tests then reuse); caps sum to 3 minutes
timeout 110 python benchmarks/profile_decode_step.py --layers 4 --batch 1,64 --top 40 --out "$OUT" > "$OUT/profile.log" 2>&1
echo "profile rc=$?"
grep -v Warn "$OUT/profile.log" | grep "^## \|splitk\|gemvx\|sgemm\|xmma\|splitKreduce\|_q_kv_\|_rms_norm\|_compress_step\|_index_q" \
  | head -40

timeout 50 python -m pytest -q -p no:cacheprovider -m cuda \
  tests/layers/test_attention_layer.py tests/layers/test_fused_projections.py tests/layers/test_attention_simulation.py \
  "tests/models/test_v4_model.py::test_decode_graph_replay_equals_eager_and_is_sync_free" \
  > "$OUT/tests_cuda.log" 2>&1
echo "cuda tests rc=$?"; tail -3 "$OUT/tests_cuda.log"
# the strided-row kernel tests take the CUDA device when present (no cuda mark)
timeout 20 python -m pytest -q -p no:cacheprovider tests/layers/test_fused_projections.py -k strided \
  > "$OUT/tests_strided.log" 2>&1
echo "strided-row tests rc=$?"; tail -2 "$OUT/tests_strided.log"
