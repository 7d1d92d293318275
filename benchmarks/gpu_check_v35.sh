#!/bin/bash
# GPU checks of 2026-11-28 (session part 24). Calls:
#   a -> issue 11: in a 1-token MoE step the HBM idles while the route launch's last program routes (~9 us) and in
#        the GEMMs' prologues / tails / launch gaps. New (kernels/l2_prefetch.py, bulk L2 prefetch): the route launch
#        pulls the fused shared expert's weights into L2 (moe.ROUTE_L2_PREFETCH "gate_up" / "all"), the gate_up GEMM's
#        programs pull the down weights of the experts they computed (moe.DOWN_L2_PREFETCH; before / after the K
#        loop, evict_last or not). CUDA tests of the prefetch paths (same bits, graph, sync-free); the V4-Flash layer
#        A/B at 1-8 tokens, read flush.
#   b -> a: every prefetch setting slower (same bits, 36 CUDA tests passed): route prefetch 0.974-0.995x, down
#        prefetch 0.85-0.93x (at 2-8 tokens the touched experts' down weights exceed the L2). Is it the bulk
#        prefetch? The same with one prefetch.global.L2 per 128-byte line (l2p.PREFETCH_LINES), V4-Flash and V4-Pro
#        at 1 / 4 tokens; the CUDA tests with the line prefetch.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v35}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PF_SETTINGS="base|moe.ROUTE_L2_PREFETCH='gate_up'|moe.ROUTE_L2_PREFETCH='all';moe.ROUTE_L2_EVICT_LAST=True"
PF_SETTINGS="$PF_SETTINGS|moe.DOWN_L2_PREFETCH=True|moe.DOWN_L2_PREFETCH=True;mma.NEXT_L2_PREFETCH_AT=1"
PF_SETTINGS="$PF_SETTINGS|moe.DOWN_L2_PREFETCH=True;mma.NEXT_L2_PREFETCH_EVICT_LAST=True"
PF_SETTINGS="$PF_SETTINGS|moe.DOWN_L2_PREFETCH=True;mma.NEXT_L2_PREFETCH_AT=1;mma.NEXT_L2_PREFETCH_EVICT_LAST=True"
PF_SETTINGS="$PF_SETTINGS|moe.ROUTE_L2_PREFETCH='gate_up';moe.DOWN_L2_PREFETCH=True"
LINES_SETTINGS="base|l2p.PREFETCH_LINES=True;moe.ROUTE_L2_PREFETCH='gate_up'"
LINES_SETTINGS="$LINES_SETTINGS|l2p.PREFETCH_LINES=True;moe.ROUTE_L2_PREFETCH='gate_up';moe.ROUTE_L2_EVICT_LAST=True"
LINES_SETTINGS="$LINES_SETTINGS|l2p.PREFETCH_LINES=True;moe.DOWN_L2_PREFETCH=True"
LINES_SETTINGS="$LINES_SETTINGS|l2p.PREFETCH_LINES=True;moe.DOWN_L2_PREFETCH=True;mma.NEXT_L2_PREFETCH_EVICT_LAST=True"
LINES_SETTINGS="$LINES_SETTINGS|moe.ROUTE_L2_PREFETCH='gate_up'"
case "$1" in
a)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_l2_prefetch.py \
    tests/kernels/gemm/test_nvfp4_mma_interleave.py tests/ops/test_moe_route_dispatch.py > "$OUT/a_tests.log" 2>&1
  tail -3 "$OUT/a_tests.log"
  timeout 380 python benchmarks/ab_layer_settings.py --configs v4-flash --tokens 1,2,4,8 --flush read --rounds 2 \
    --settings "$PF_SETTINGS" --out "$OUT" --tag a_l2pf_flash 2>&1 | tail -40
  ;;
b)
  MEGAMOE_L2_PREFETCH_LINES=1 timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/kernels/test_l2_prefetch.py > "$OUT/b_tests_lines.log" 2>&1
  tail -1 "$OUT/b_tests_lines.log"
  timeout 400 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,4 --flush read --rounds 2 \
    --settings "$LINES_SETTINGS" --out "$OUT" --tag b_l2pf_lines 2>&1 | tail -40
  ;;
esac
