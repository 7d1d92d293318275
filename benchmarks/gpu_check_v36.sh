#!/bin/bash
# GPU checks of 2026-11-28 (session part 25). Calls:
#   a -> issue 11: at 1 token the V4-Flash gate_up launch has 224 busy programs of 8 warps on 132 SMs (2 per SM):
#        92 SMs hold two, 40 hold one. Is an SM's throughput or each program's latency chain the pace? The one-wave
#        config over 1..8 touched groups, and 7 groups under programs of 1 / 2 / 4 / 8 warps of 16 rows
#        (probe_decode_balance.py), V4-Flash and V4-Pro gate_up / down.
#   b -> a: with enough programs the 1-token GEMMs stream at 2.6-2.7 TB/s (the chunks sweep); smaller programs are
#        slower; what is left is fixed cost per launch. PDL per kernel boundary (pdl.PDL_PROLOGUE / PDL_LAUNCH): the
#        combine launched early under the down GEMM; the GEMMs early under the route; both; all (PDL_ENABLED). The
#        PDL tests on the GPU; the layer A/B at 1-8 tokens, V4-Flash and V4-Pro, read flush.
#   c -> b: at 1 token every early boundary helps (route prologue + early GEMMs + early combine: 1.030x V4-Flash,
#        1.016x V4-Pro); early GEMMs whose programs loop (2-4 tokens) lose 4.6-5.5%; the early combine alone is
#        1.000-1.009x. (b's PDL tests were cut by the 120 s timeout while compiling.) New default (pdl.PDL_PROLOGUE =
#        route_dispatch, mma_decode; PDL_LAUNCH = mma_decode where its grid is a single pass, combine): PDL tests and
#        the MoE layer's; the layer A/B default vs all off at 1 / 2 / 8 / 64 tokens.
#   d -> c: the default holds (1 token 1.010-1.019x, others 0.998-1.005x; 30 CUDA tests passed). Issue 11's dense
#        M = 1 target: the split-K route runs the FMA step (5.3 instructions per weight) at M = 1; its mma.sync kind
#        (3.1 per weight) was only measured from M = 8. sweep_dense_m1.py: both kinds, several configs.
#   e -> d: at M = 1 the mma kind (8, 128, 256, 4 warps, 3 per SM) takes 18432x7168 from 37.7 to 35.0 us (66 -> 71% of
#        the floor); (8, 64, 256, 4, 4 per SM, 128 registers) is 1-4% ahead on the other shapes. The same at M = 1 / 2 /
#        4, 1024x4096 added, against each M's split-K default.
#   f -> e: the mma kind wins at M = 2 / 4 on every shape (up to 2.1x: 18432x7168 M = 4 76.7 -> 36.0 us) and at M = 1
#        except 1024x4096. New split-K class configs (MMA_SMALL_M_CONFIG / _HUGE_CONFIG at M <= 4; the small class
#        keeps FMA at M = 1). CUDA split-K and dense-op tests; the op at M = 1 / 2 / 4 / 8 against the FMA kind
#        and bf16.
#   g -> f: the op at M <= 4 as measured (18432x7168 M = 1 72% of the floor); 130 CUDA tests passed. The model and
#        attention-layer CUDA tests (their dense linears at decode sizes now take the mma kind); M = 8 under the
#        three mma configs (M = 8 keeps SPLITK_CONFIGS[8] today).
#   h -> g: M = 8 keeps its config; 20 model / attention CUDA tests passed. plan_splitk rounds the split count to the
#        nearest, so the huge class (144 n-tiles x 3 splits = 432 programs of 396 resident) and 32768x1024 at M = 8 run
#        a partial second wave. Forced split counts against the planned one at M = 1 / 4 / 8.
#   i -> h: the planned split counts hold (one exception, 32768x1024 at M = 8, left). The kernels now built with the
#        PDL prologue by default (route + dispatch, mma.sync decode) and launched with it (single-pass decode GEMMs,
#        combine): their op-level CUDA tests.
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
b)
  timeout 120 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_pdl.py \
    > "$OUT/b_tests.log" 2>&1
  tail -1 "$OUT/b_tests.log"
  S="base|pdl.PDL_PROLOGUE=frozenset({'mma_decode'});pdl.PDL_LAUNCH=frozenset({'combine'})"
  S="$S|pdl.PDL_PROLOGUE=frozenset({'route_dispatch'});pdl.PDL_LAUNCH=frozenset({'mma_decode'})"
  S="$S|pdl.PDL_PROLOGUE=frozenset({'route_dispatch'});pdl.PDL_LAUNCH=frozenset({'mma_decode','combine'})"
  S="$S|pdl.PDL_ENABLED=True"
  timeout 450 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,2,4,8 --flush read \
    --rounds 2 --settings "$S" --out "$OUT" --tag b_pdl_boundary 2>&1 | tail -30
  ;;
c)
  timeout 330 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/test_pdl.py \
    tests/layers/test_moe_layer.py > "$OUT/c_tests.log" 2>&1
  tail -1 "$OUT/c_tests.log"
  timeout 250 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 1,2,8,64 --flush read \
    --rounds 2 --settings "base|pdl.PDL_PROLOGUE=frozenset();pdl.PDL_LAUNCH=frozenset()" --out "$OUT" \
    --tag c_pdl_default 2>&1 | tail -20
  ;;
d)
  timeout 400 python benchmarks/sweep_dense_m1.py --out "$OUT" 2>&1 | tail -12
  ;;
e)
  timeout 400 python benchmarks/sweep_dense_m1.py --rows 1,2,4 --configs 0,2,3,4 --tag e --out "$OUT" 2>&1 | tail -20
  ;;
f)
  timeout 330 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_splitk.py \
    tests/ops/test_gemm.py > "$OUT/f_tests.log" 2>&1
  tail -1 "$OUT/f_tests.log"
  timeout 200 python benchmarks/sweep_dense_m1.py --rows 1,2,4,8 --configs 0 --tag f --out "$OUT" 2>&1 | tail -24
  ;;
g)
  timeout 60 python benchmarks/sweep_dense_m1.py --rows 8 --configs 2,3,4 --tag g --out "$OUT" 2>&1 | tail -8
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/models/test_v4_model.py \
    tests/layers/test_attention_layer.py tests/layers/test_fused_projections.py \
    tests/layers/test_attention_simulation.py > "$OUT/g_tests.log" 2>&1
  tail -1 "$OUT/g_tests.log"
  ;;
h)
  timeout 120 python benchmarks/sweep_dense_m1.py --rows 1,4 --configs 2 --splits 1,2,4 --tag h --out "$OUT" \
    2>&1 | tail -14
  timeout 60 python benchmarks/sweep_dense_m1.py --rows 8 --configs 2 --splits 1,2 --tag h8 --out "$OUT" 2>&1 | tail -8
  ;;
i)
  timeout 320 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_moe_route_dispatch.py \
    tests/ops/test_moe_ops.py tests/ops/test_gemm_bands.py tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    > "$OUT/i_tests.log" 2>&1
  tail -3 "$OUT/i_tests.log"
  ;;
esac
