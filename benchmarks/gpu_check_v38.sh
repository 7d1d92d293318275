#!/bin/bash
# GPU checks of 2026-11-28 (session part 27). Calls:
#   a -> issue 10 / 11 at 9-128 tokens: the shared expert apart runs after the routed GEMMs, serially (~30 us at 64
#        tokens on V4-Flash). Nvfp4MoE(shared_overlap=True) forks it onto a side stream before the routing; so far it
#        kept the grouped GEMMs there (split-K's single-launch reduction shares the device's tile counters). Now the
#        side stream takes split-K above nvfp4_splitk.FUSED_MAX_ROWS rows, where split-K reduces in a second launch
#        without counters (moe.SHARED_OVERLAP_SPLITK). CUDA test of the overlap path (same bits as the separate path,
#        graph == eager, sync-free); the layer A/B at 9-128 tokens, three routings, both models: the defaults, the
#        overlap with split-K, the overlap without it.
#   b -> a: the overlap with split-K is 1.10-1.16x at all-on-k (9-128 tokens, both models) and 1.000-1.039x under the
#        router and Zipf on V4-Flash; V4-Pro router / Zipf 0.89-1.02x with noisy rounds (up to 20% apart). The default
#        layer now overlaps at 9-128 tokens (shared_overlap=None, w4a16, CUDA). CUDA tests of the MoE layer and the V4
#        model (graphs with the fork); the default against shared_overlap=False, 3 rounds.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v38}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    -k "shared_overlap or shared_expert_dense" > "$OUT/a_tests.log" 2>&1
  tail -1 "$OUT/a_tests.log"
  S="base|layer.shared_overlap=True|layer.shared_overlap=True;moe.SHARED_OVERLAP_SPLITK=False"
  timeout 420 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 9,16,32,64,128 \
    --flush read --rounds 2 --routings router,zipf,all-on-k --settings "$S" --out "$OUT" --tag a_shared_overlap \
    2>&1 | tail -40
  ;;
b)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    > "$OUT/b_tests.log" 2>&1
  tail -1 "$OUT/b_tests.log"
  timeout 160 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/models/test_v4_model.py \
    >> "$OUT/b_tests.log" 2>&1
  tail -1 "$OUT/b_tests.log"
  timeout 220 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 9,16,32,64,128 \
    --flush read --rounds 3 --routings router,zipf,all-on-k --settings "base|layer.shared_overlap=False" --out "$OUT" \
    --tag b_overlap_default 2>&1 | tail -3
  ;;
esac
