#!/usr/bin/env bash
# One device call that checks the whole project on a GPU: versions, the full
# test-suite (CUDA tests included; kernel tests run on the GPU, not the
# interpreter), and the CLI jobs. Logs go to $OUT (default /tmp/megamoe-gpu-check).
# Usage: bash benchmarks/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check}
mkdir -p "$OUT"
status=0
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
python -m megamoe quantize-check --rows 4096 --cols 7168 2>&1 | tee "$OUT/cli.txt" || status=1
python -m megamoe run --tokens 1 --graph 2>&1 | tee -a "$OUT/cli.txt" || status=1
python -m megamoe run --tokens 64 --graph 2>&1 | tee -a "$OUT/cli.txt" || status=1
python -m megamoe run --tokens 64 --mode w4a4 2>&1 | tee -a "$OUT/cli.txt" || status=1
echo "gpu_check status: $status"
exit $status
