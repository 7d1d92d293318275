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
#   c -> b: the line prefetch as slow (9 CUDA tests passed); L2 prefetch reverted. Issue 10's all-on-k 64-token
#        point: the routed experts' 64 rows run as two mma.sync 32-row chunks (two passes over the weights);
#        PIPE_AFTER_DECODE (pipelined bands for every row above the decode band) fixes that but adds empty launches
#        and lost 3-9% at uniform / Zipf 64 tokens. New: gemm.PIPE_ABOVE_MMA_ROWS (chunks up to 32 rows, the
#        pipelined 64-row band above). CUDA band tests; the layer A/B against both at 16 / 64 / 128 tokens, router /
#        Zipf / all-on-k routings, V4-Flash and V4-Pro.
#   d -> c: PIPE_ABOVE_MMA_ROWS=32 takes all-on-k 64 tokens from 184.0 to 120.0 us (V4-Flash) and 438.1 to 283.9 us
#        (V4-Pro), V4-Pro Zipf 128 1.033x, but V4-Flash Zipf 64 / 128 0.968 / 0.960x and the router's routing 0.991-
#        0.996x (an empty pipelined launch plus its x copy). Are the Zipf losses the hot experts of 33-47 rows in
#        half-empty 64-row tiles? The same A/B with the threshold at 40 and 48 rows.
#   e -> d: 40 / 48 rows do not help V4-Flash Zipf (0.967 / 0.907x at 64 tokens): the split of the hot experts over
#        two launches in series is the cost, not half-empty tiles. New default: PIPE_ABOVE_MMA_ROWS=32 where N >= 6144
#        (V4-Pro's GEMMs; V4-Flash's N 4096 keeps the chunks). CUDA tests (bands, MoE layer, paired order); the layer
#        with the new default against the knob off.
#   f -> e: the default as measured (V4-Flash unchanged, V4-Pro all-on-k 64 1.54x); 87 CUDA tests passed. Issue 10's
#        skew benchmark (bf16 layer and floor in the same run) at 64 tokens with the new default; the 1-token layer's
#        kernels (probe, L2 warm) for the closing note.
#   g -> f: skew benchmark at 64 tokens: all-on-k 4.93x (V4-Flash) / 3.03x (V4-Pro) of the floor, uniform and Zipf
#        1.10-1.33x. V4-Flash's Zipf loss with the pipelined band was too few programs per hot expert (16 tiles of
#        256 columns). The band with 128-column tiles, one warpgroup, two programs per SM ((64, 128, 128, 4, 4, 2):
#        offline 255 registers, no spills; 32 tiles per V4-Flash expert), forced on for both models.
#   h -> g: the 128-column 64-row band fixes V4-Flash's Zipf 64 (1.000x) and takes all-on-k 64 to 117.6 us (1.568x);
#        at 128 tokens V4-Flash still loses 2.6-4% (Zipf / all-on-k). New default: 256-column tiles where N >= 6144,
#        else 128-column tiles while the row hint is <= 64. CUDA tests (bands incl. both band configs, the MoE
#        layer); the default against off at 48 / 64 / 128 tokens.
#   i -> h: the band stays opt-in (Zipf 48 tokens 0.92x / 0.97x). The shared expert's kernel weights now from
#        reference.gemm.one_expert_weight (a 0-d global scale stays 0-d): the MoE layers' CUDA tests.
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
c)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    -k "concurrent_bands or skewed or graph_replay" > "$OUT/c_tests.log" 2>&1
  tail -1 "$OUT/c_tests.log"
  timeout 430 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 16,64,128 \
    --routings router,zipf,all-on-k --flush read --rounds 2 \
    --settings "base|gemm.PIPE_ABOVE_MMA_ROWS=32|gemm.PIPE_AFTER_DECODE=True" --out "$OUT" --tag c_pipe_above \
    2>&1 | tail -60
  ;;
d)
  timeout 400 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 64,128 \
    --routings router,zipf,all-on-k --flush read --rounds 2 \
    --settings "base|gemm.PIPE_ABOVE_MMA_ROWS=32|gemm.PIPE_ABOVE_MMA_ROWS=40|gemm.PIPE_ABOVE_MMA_ROWS=48" --out "$OUT" \
    --tag d_pipe_above 2>&1 | tail -60
  ;;
e)
  timeout 250 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    tests/layers/test_moe_layer.py tests/ops/test_gemm_paired_order.py > "$OUT/e_tests.log" 2>&1
  tail -1 "$OUT/e_tests.log"
  timeout 300 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 8,64,128 \
    --routings router,zipf,all-on-k --flush read --rounds 2 \
    --settings "base|gemm.PIPE_ABOVE_MMA_ROWS=0" --out "$OUT" --tag e_pipe_above_default 2>&1 | tail -40
  ;;
f)
  timeout 420 python benchmarks/bench_moe_skew.py --configs v4-flash,v4-pro --tokens 64 \
    --routings uniform,zipf,all-on-k --out-dir "$OUT" --tag f_moe_skew 2>&1 | tail -12
  timeout 150 python benchmarks/probe_moe_decode.py --configs v4-flash,v4-pro --tokens 1 --row-interleave 4 \
    --out "$OUT" --tag f_one_token 2>&1 | tail -4
  ;;
g)
  timeout 450 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 64,128 \
    --routings router,zipf,all-on-k --flush read --rounds 2 \
    --settings "base|gemm.PIPE_ABOVE_MIN_N=0|gemm.PIPE_ABOVE_MIN_N=0;gemm.PIPE_ABOVE_CONFIG=(64,128,128,4,4,2)" \
    --out "$OUT" --tag g_pipe_above_bn128 2>&1 | tail -40
  ;;
h)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    tests/layers/test_moe_layer.py > "$OUT/h_tests.log" 2>&1
  tail -1 "$OUT/h_tests.log"
  timeout 300 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 48,64,128 \
    --routings router,zipf,all-on-k --flush read --rounds 2 \
    --settings "base|gemm.PIPE_ABOVE_MMA_ROWS=0" --out "$OUT" --tag h_pipe_above_default 2>&1 | tail -40
  ;;
i)
  timeout 280 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    tests/layers/test_moe_hash_layer.py > "$OUT/i_tests.log" 2>&1
  tail -1 "$OUT/i_tests.log"
  ;;
esac
