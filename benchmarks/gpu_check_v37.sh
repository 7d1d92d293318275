#!/bin/bash
# GPU checks of 2026-11-28 (session part 26). Calls:
#   a -> issue 11: where the decode layer's time goes today (route + dispatch, gate_up, down, combine) at 1 / 2 / 8
#        tokens on V4-Flash and V4-Pro, the layer's interleaved weights (probe_moe_decode.py).
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v37}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 500 python benchmarks/probe_moe_decode.py --configs v4-flash,v4-pro --tokens 1,2,8 --row-interleave 4 \
    --out "$OUT" --tag a_decode 2>&1 | tail -5
  ;;
esac
