#!/bin/bash
# GPU checks of 2026-11-27 (session part 21). Calls:
#   a -> issue 11: the mma.sync decode kernel's K step (one-wave config, offline SASS) is 452 instructions, 32 of them
#        byte permutes that build the x half of each MMA's B operand. New: x in the paired order (X_PAIRED; the x
#        permutes gone, 420 instructions). Its CUDA tests (same bits), the op-level A/B of the layer's two GEMMs with a
#        paired x made outside the graph (the kernel's gain alone), the layer A/B with the launcher's copy inside
#        (MMA_X_PAIRED, what it costs today), and ncu's warp-state sampling of the four 1-token GEMMs.
#   b -> a: the paired x is 1.02-1.03x on the GEMMs (V4-Pro down 0.99x); ncu: 13 of 16 warps active per SM, 5.2-5.8
#        cycles per issued instruction, DRAM 47-60%. Where the rest goes: the fixed part of one decode GEMM from a
#        K sweep (probe_decode_intercept.py), ncu's stall reasons (raw metrics), and the layer A/B that failed in a
#        (the paired copy built a host index tensor inside the capture; now a transpose).
#   c -> b (on an H200): ncu shows math-pipe throttle, long scoreboard and "not selected" stalls of similar size; the
#        layer with the launcher's extra copies was already 1.03-1.05x at 8 tokens. Now the paired x costs no launch:
#        the route + dispatch launch writes it, gate_up reads it and writes its SwiGLU output paired, down reads
#        that (Nvfp4MoE, up to PAIRED_X_MAX_TOKENS = 8 tokens; nvfp4_grouped_mm x_order / out_order). CUDA tests
#        (op, layer, route + dispatch, decode kernel), the layer A/B against PAIRED_X_MAX_TOKENS = 0 at 1-8 tokens
#        and the layer benchmark at 1 / 8 / 64 tokens.
#   d -> c ran on an H200 (99 CUDA tests passed; layer 1.03-1.07x at 1 / 4 / 8 tokens, 0.99x at V4-Flash 2). The same
#        on an H100 (the machine), with the model CUDA tests and the README main job (generate) on the GPU.
#   e -> d (H100): the layer lost up to 3% (V4-Pro 1 token) where the GEMMs alone gained 2-3%: the route + dispatch
#        launch's copy, suspected: its permuted-position stores need a CHUNK-wide index, which the compiler may keep
#        live in every program (not checked). Now one in-register permute of the x it holds, stored contiguously. The route + dispatch op with / without
#        the copy (bench_route.py --paired, registers and spills of both builds), the layer A/B again, and the CUDA
#        tests that d's 300 s limit cut (the model tests).
#   f -> the final code (the layer takes the paired x at 8 tokens only, where e measured it faster): the CUDA tests of
#        the op, the layer, the route op, the decode kernel, the bands, the models and PDL.
#   g -> e: the route launch's copy cost 2.1 us at V4-Pro 1 token, where the grid runs in two waves (384 programs): one
#        late first-wave program delays a second-wave one. Now every program copies a few 8-element groups. The
#        route op with / without the copy, the layer with the paired x at 1-8 tokens against plain, the route and
#        layer CUDA tests.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v32}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/kernels/gemm/test_nvfp4_mma_interleave.py > "$OUT/a_tests.log" 2>&1
  tail -3 "$OUT/a_tests.log"
  timeout 200 python benchmarks/probe_x_paired.py --configs v4-flash,v4-pro --tokens 1,8 --rounds 3 --flush read \
    --out "$OUT" --tag a 2>&1 | tail -8
  timeout 120 ncu --kernel-name regex:mma_decode --launch-skip 4 --launch-count 4 --section WarpStateStats \
    --section SpeedOfLight --section Occupancy --csv python benchmarks/probe_x_paired.py --ncu \
    > "$OUT/a_ncu.csv" 2> "$OUT/a_ncu.err"; tail -2 "$OUT/a_ncu.err"; wc -l "$OUT/a_ncu.csv"
  timeout 200 python benchmarks/ab_layer_settings.py --settings "base|mma.MMA_X_PAIRED=True" \
    --configs v4-flash,v4-pro --tokens 1,8 --rounds 2 --flush read --out "$OUT" --tag a_x_paired 2>&1 | tail -5
  ;;
b)
  timeout 150 python benchmarks/probe_decode_intercept.py --out "$OUT/b_intercept.md" 2>&1 | tail -6
  timeout 150 python benchmarks/probe_decode_intercept.py --n 6144 --ks 1792,3584,7168 --out "$OUT/b_intercept_pro.md" \
    2>&1 | tail -2
  timeout 120 ncu --kernel-name regex:mma_decode --launch-skip 4 --launch-count 4 --csv --page raw \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__warps_active.avg.per_cycle_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum" \
    python benchmarks/probe_x_paired.py --ncu > "$OUT/b_ncu_stalls.csv" 2> "$OUT/b_ncu.err"; tail -2 "$OUT/b_ncu.err"
  timeout 200 python benchmarks/ab_layer_settings.py --settings "base|mma.MMA_X_PAIRED=True" \
    --configs v4-flash,v4-pro --tokens 1,8 --rounds 2 --flush read --out "$OUT" --tag b_x_paired 2>&1 | tail -5
  ;;
c)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_paired_order.py \
    tests/layers/test_moe_layer.py tests/ops/test_moe_route_dispatch.py tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    tests/ops/test_gemm_bands.py > "$OUT/c_tests.log" 2>&1
  tail -3 "$OUT/c_tests.log"
  timeout 240 python benchmarks/ab_layer_settings.py --settings "base|moe.PAIRED_X_MAX_TOKENS=0" \
    --configs v4-flash,v4-pro --tokens 1,2,4,8 --rounds 3 --flush read --out "$OUT" --tag c_paired 2>&1 | tail -16
  ;;
d)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_paired_order.py \
    tests/layers/test_moe_layer.py tests/ops/test_moe_route_dispatch.py tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    tests/models tests/kernels/test_pdl.py > "$OUT/d_tests.log" 2>&1
  tail -3 "$OUT/d_tests.log"
  timeout 240 python benchmarks/ab_layer_settings.py --settings "base|moe.PAIRED_X_MAX_TOKENS=0" \
    --configs v4-flash,v4-pro --tokens 1,2,4,8 --rounds 3 --flush read --out "$OUT" --tag d_paired_h100 2>&1 | tail -16
  timeout 150 python -m megamoe generate --layers 4 --batch 1,8 > "$OUT/d_generate.log" 2>&1; tail -4 "$OUT/d_generate.log"
  ;;
e)
  timeout 120 python benchmarks/bench_route.py --tokens 1,8 --paired --out "$OUT/e_route_paired.md" 2>&1 | tail -8
  timeout 240 python benchmarks/ab_layer_settings.py --settings "base|moe.PAIRED_X_MAX_TOKENS=0" \
    --configs v4-flash,v4-pro --tokens 1,2,4,8 --rounds 3 --flush read --out "$OUT" --tag e_paired_h100 2>&1 | tail -16
  timeout 220 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_moe_route_dispatch.py \
    tests/layers/test_moe_layer.py tests/models > "$OUT/e_tests.log" 2>&1
  tail -3 "$OUT/e_tests.log"
  ;;
f)
  timeout 560 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_paired_order.py \
    tests/layers/test_moe_layer.py tests/ops/test_moe_route_dispatch.py tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    tests/ops/test_gemm_bands.py tests/models tests/kernels/test_pdl.py > "$OUT/f_tests.log" 2>&1
  tail -3 "$OUT/f_tests.log"
  ;;
g)
  timeout 120 python benchmarks/bench_route.py --tokens 1,8 --paired --out "$OUT/g_route_paired.md" 2>&1 | grep "^|"
  timeout 240 python benchmarks/ab_layer_settings.py --settings "moe.PAIRED_X_MIN_TOKENS=1|moe.PAIRED_X_MAX_TOKENS=0" \
    --configs v4-flash,v4-pro --tokens 1,2,4,8 --rounds 3 --flush read --out "$OUT" --tag g_paired_h100 2>&1 | tail -16
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_moe_route_dispatch.py \
    tests/layers/test_moe_layer.py -k "paired or route" > "$OUT/g_tests.log" 2>&1
  tail -3 "$OUT/g_tests.log"
  ;;
esac
