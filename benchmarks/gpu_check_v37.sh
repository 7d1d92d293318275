#!/bin/bash
# GPU checks of 2026-11-28 (session part 26). Calls:
#   a -> issue 11: where the decode layer's time goes today (route + dispatch, gate_up, down, combine) at 1 / 2 / 8
#        tokens on V4-Flash and V4-Pro, the layer's interleaved weights (probe_moe_decode.py).
#   b -> a: at 1 token the down GEMM starts ~2 us after gate_up ends (tile table from offsets, then the first weights
#        from HBM, all after its PDL wait). pdl.PDL_EARLY_READS: the down GEMM reads its routing and first weight step
#        before the wait (nvfp4_grouped_mm(index_settled=True)). PDL tests (incl. the layer with it) and the op test;
#        the layer A/B at 1 / 2 tokens (2: the down grid loops, so no PDL launch: a control), both models.
#   c -> b: the early reads take V4-Flash 1 token 60.6 -> 58.2 us (V4-Pro 124.7 -> 124.2), same bits: now the default.
#        The route + dispatch launch (9.1 us at 1 token) has one GEMV program per expert, each drawing a ticket on one
#        counter: rd.SMALL_T_BLOCK_E = 2 / 4 / 8 experts per program (fewer programs and tickets, more loads each).
#        Route tests (the several-experts plan included); the layer A/B at 1 / 2 / 8 tokens, both models.
#   d -> c: 2-8 experts per route program: within +-1% (2 tokens 1.008x, 8 tokens 0.98-1.008x): not a lever, the
#        default stays 1. The combine may read inv_perm and the weights (the routing's) before its PDL wait too
#        (moe_ops.combine(index_settled=True)): CUDA tests of the combine and PDL; the layer A/B with "combine" added to
#        PDL_EARLY_READS at 1 / 2 / 8 tokens.
#   e -> d: the combine's early reads 1.000-1.002x: reverted. At 2-8 tokens the down GEMM's grid loops, so it is launched
#        plainly (PDL only for single-pass grids: looping early GEMMs lost 5% in part 25, before the early reads). With
#        pdl.PDL_LOOPING_EARLY_READS the down GEMM (early reads) is launched with PDL there too. PDL layer tests with it;
#        the layer A/B at 2 / 4 / 8 tokens, both models.
#   f -> e: looping down grids with PDL 0.947-1.019x: reverted. Issue 10's skew point: the banded route's launches run
#        one after another (decode band, 32-row chunks, with PIPE_ABOVE_MMA_ROWS the pipelined 64-row band), so a few
#        hot experts in a later band run alone. gemm.BANDS_OVERLAP: later bands launched with PDL beside the earlier
#        ones (trigger first, wait for the previous band at exit; disjoint rows, same bits). CUDA tests of the bands
#        (same bits as in order, graphs after the routing moved) and PDL; the layer A/B at 16 / 48 / 64 tokens under
#        the router, Zipf and all-on-k, with and without PIPE_ABOVE_MMA_ROWS = 32.
#   g -> f: BANDS_OVERLAP with PIPE_ABOVE_MMA_ROWS = 32 is the best pair almost everywhere (V4-Flash all-on-k 64 183.0 ->
#        114.5 us, Zipf 16 / 64 1.11 / 1.06x; worst Zipf 48 0.985x, routers 0.996-1.005x). Both are the defaults now
#        (the overlap for plans with a decode band only). CUDA tests of the bands, the MoE layer and PDL; the layer
#        against the old defaults at 9 / 12 / 32 / 64 / 96 / 128 tokens, three routings, both models.
#   h -> g: the new defaults against the old: 0.98-1.13x at 9-128 tokens (V4-Pro all-on-k 12 0.982x the one loss),
#        all-on-k 64 1.56-1.60x; 99 CUDA tests passed. Issue 10's skew table (bench_moe_skew.py) at 8 / 64 tokens.
#   i -> h: the skew table's 8-token rows read rel err ~1 vs bf16: the benchmark's forced-routing stand-in did not write
#        the paired x that the GEMMs read at 1-8 tokens (fixed). The table again; the README main job (generate) on the
#        GPU with the new band defaults; the V4 model's CUDA tests.
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
b)
  timeout 240 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_pdl.py \
    tests/ops/test_gemm_paired_order.py -k "moe_layer or paired" > "$OUT/b_tests.log" 2>&1
  tail -1 "$OUT/b_tests.log"
  timeout 300 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,2 --flush read --rounds 3 \
    --settings "base|pdl.PDL_EARLY_READS=frozenset({'mma_decode'})" --out "$OUT" --tag b_early_reads 2>&1 | tail -12
  ;;
c)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_moe_route_dispatch.py \
    > "$OUT/c_tests.log" 2>&1
  tail -1 "$OUT/c_tests.log"
  timeout 380 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,2,8 --flush read --rounds 2 \
    --settings "base|rd.SMALL_T_BLOCK_E=2|rd.SMALL_T_BLOCK_E=4|rd.SMALL_T_BLOCK_E=8" --out "$OUT" \
    --tag c_route_block_e 2>&1 | tail -26
  ;;
d)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/ops/test_moe_ops.py -k "combine" \
    > "$OUT/d_tests.log" 2>&1
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_pdl.py -k moe_layer \
    >> "$OUT/d_tests.log" 2>&1
  grep -E "passed|failed" "$OUT/d_tests.log"
  timeout 330 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,2,8 --flush read --rounds 3 \
    --settings "base|pdl.PDL_EARLY_READS=frozenset({'mma_decode','combine'})" --out "$OUT" --tag d_combine_early \
    2>&1 | tail -12
  ;;
e)
  MEGAMOE_PDL_LOOPING_EARLY_READS=1 timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/kernels/test_pdl.py -k moe_layer > "$OUT/e_tests.log" 2>&1
  tail -1 "$OUT/e_tests.log"
  timeout 330 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 2,4,8 --flush read --rounds 3 \
    --settings "base|pdl.PDL_LOOPING_EARLY_READS=True" --out "$OUT" --tag e_looping_early 2>&1 | tail -12
  ;;
f)
  timeout 260 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    -k "concurrent" > "$OUT/f_tests.log" 2>&1
  tail -1 "$OUT/f_tests.log"
  S="base|gemm.BANDS_OVERLAP=True|gemm.PIPE_ABOVE_MMA_ROWS=32|gemm.PIPE_ABOVE_MMA_ROWS=32;gemm.BANDS_OVERLAP=True"
  timeout 320 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 16,48,64 --flush read \
    --rounds 2 --routings router,zipf,all-on-k --settings "$S" --out "$OUT" --tag f_bands_overlap 2>&1 | tail -40
  ;;
g)
  timeout 280 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    tests/layers/test_moe_layer.py > "$OUT/g_tests.log" 2>&1
  tail -1 "$OUT/g_tests.log"
  timeout 300 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 9,12,32,64,96,128 \
    --flush read --rounds 2 --routings router,zipf,all-on-k \
    --settings "base|gemm.BANDS_OVERLAP=False;gemm.PIPE_ABOVE_MMA_ROWS=0" --out "$OUT" --tag g_new_defaults \
    2>&1 | tail -3
  ;;
h)
  timeout 330 python benchmarks/bench_moe_skew.py --configs v4-flash,v4-pro --tokens 8,64 \
    --routings uniform,zipf,all-on-k --out-dir "$OUT" --tag h_moe_skew 2>&1 | tail -14
  ;;
i)
  timeout 150 python benchmarks/bench_moe_skew.py --configs v4-flash,v4-pro --tokens 8,64 \
    --routings uniform,zipf,all-on-k --out-dir "$OUT" --tag i_moe_skew 2>&1 | tail -13
  timeout 240 python -m megamoe generate > "$OUT/i_generate.log" 2>&1; tail -14 "$OUT/i_generate.log"
  timeout 160 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/models/test_v4_model.py \
    > "$OUT/i_tests.log" 2>&1
  tail -1 "$OUT/i_tests.log"
  ;;
esac
