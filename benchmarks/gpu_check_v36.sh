#!/bin/bash
# GPU checks of 2026-11-28 (session part 25). Calls:
#   a -> issue 11: at 1 token the V4-Flash gate_up launch has 224 busy programs of 8 warps on 132 SMs (2 per SM):
#        92 SMs hold two, 40 hold one. Is an SM's throughput or each program's latency chain the pace? The one-wave
#        config over 1..8 touched groups, and 7 groups under programs of 1 / 2 / 4 / 8 warps of 16 rows
#        (probe_decode_balance.py), V4-Flash and V4-Pro gate_up / down.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v36}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 400 python benchmarks/probe_decode_balance.py --out "$OUT/a_balance.md" 2>&1 | tail -60
  ;;
esac
