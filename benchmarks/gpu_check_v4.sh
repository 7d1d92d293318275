#!/usr/bin/env bash
# One device call for the DeepSeek-V4 system: CUDA tests of the attention kernel, top-k, kv cache, sampler,
# hash routing, hyper-connections and the model; then the generate job at V4-Flash dimensions.
# Logs go to $OUT (default /tmp/megamoe-gpu-check-v4). Usage: bash benchmarks/gpu_check_v4.sh [pytest -k expr]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v4}
mkdir -p "$OUT"
status=0
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout 420 python -m pytest -q -p no:cacheprovider -m cuda \
  tests/models tests/kvcache tests/kernels/test_topk.py tests/ops/test_sampling.py tests/ops/test_hyper_connection.py \
  tests/ops/test_moe_ops.py tests/layers 2>&1 | tail -40 | tee "$OUT/gpu_tests_v4.txt" || status=1
echo "gpu_check_v4 status: $status"
exit $status
