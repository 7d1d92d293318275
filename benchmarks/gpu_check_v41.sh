#!/bin/bash
# GPU checks of 2026-11-28 (session part 30). Calls:
#   a -> the whole CUDA-marked suite at once (754 tests), sharded by benchmarks/run_cuda_suite.py over the GPUs of
#        the machine (4 processes per GPU, 530 s). 512 tests ran, none failed; 242 were not reached (a shard whose
#        first test, the sparse official-numerics model test, did not end in time, and shards of slow files).
#   b -> the 242 tests a did not reach (a_not_reached.txt), the two official-numerics model tests in shards of their own.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v41}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  python benchmarks/run_cuda_suite.py --procs-per-gpu "${PROCS:-4}" --timeout "${SUITE_TIMEOUT:-530}" --out "$OUT/a_suite" \
    > "$OUT/a_suite.txt" 2>&1
  tail -40 "$OUT/a_suite.txt"
  ;;
b)
  python benchmarks/run_cuda_suite.py --procs-per-gpu "${PROCS:-4}" --timeout "${SUITE_TIMEOUT:-540}" --out "$OUT/b_suite" \
    --ids-from benchmarks/results/gpu_check_v41/a_not_reached.txt --alone "official_numerics_bounded" > "$OUT/b_suite.txt" 2>&1
  tail -40 "$OUT/b_suite.txt"
  ;;
esac
