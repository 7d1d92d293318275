#!/usr/bin/env bash
# 2026-11-25. One H100, < 4 min. `bash benchmarks/gpu_v18_megamoe.sh` (logs and results into "$OUT"):
#   1. CUDA tests of the single-launch decode MoE ("MegaMoE" v1, issue 11): V4-Flash shapes at 1/4/8/16 tokens vs
#      the existing path within the float32 bound, graph == eager, sync-free, same bits twice (counters reset),
#      one launch == two-phase launches; the layer's CUDA test; the offline sm_90 build (registers, no spills).
#   2. benchmarks/bench_moe_fused_decode.py: V4-Flash and V4-Pro, 1/2/4/8/16 tokens, existing vs fused (graph
#      replay, L2 flushed), HBM floor, same bits, rel errors -> "$OUT/moe_fused_decode_v1.{md,json}".
# If step 1 hangs (a deadlock in the single launch would hang the process), the timeout ends it; the log then
# ends at the hanging test. MEGAMOE_MOE_FUSED_PHASES is not a switch: phases=2 is tested explicitly.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-v18-megamoe}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/device.txt"
timeout 120 python -m pytest -q -p no:cacheprovider \
  tests/kernels/test_moe_fused_decode.py \
  "tests/layers/test_moe_layer.py::test_cuda_fused_decode_graph_sync_free" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$OUT/tests.log"
timeout 110 python benchmarks/bench_moe_fused_decode.py --configs v4-flash,v4-pro --tokens 1,2,4,8,16 --iters 30 \
  --out-dir "$OUT" --tag moe_fused_decode_v1 > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep "^| \|T=" "$OUT/bench.log" | tail -14
