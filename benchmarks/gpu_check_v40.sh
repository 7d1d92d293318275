#!/bin/bash
# GPU checks of 2026-11-28 (session part 29). Calls:
#   a -> issue 11's dense linears: the split-K kernel gained a PDL prologue (all kinds) and, for a one-pass launch of
#        the mma.sync / CUDA-core kind whose caller vouches for the weights (nvfp4_linear(weight_settled=True), which
#        DenseLinear passes), early reads: the first weight step is loaded before the PDL wait. Off by default ("splitk"
#        is in no PDL set). CUDA tests (split-K, PDL incl. the tiny model with the switch on + split-K early reads);
#        bench_dense_pdl.py: plain / pdl / pdl+early / bf16 per call, 32 calls per graph, the five shapes.
#   b -> a: tests 124 passed. Per call, pdl+early against plain: 1024x4096 / 4096x4096 M = 1 6.1 -> 4.7 / 8.5 -> 7.2 us,
#        but 18432x7168 M = 1-8 30.4-38.5 -> 33.1-41.3 (its plan is 432 programs on 396 slots: two waves) and the wgmma
#        kind at M = 64 (two launches) 14.7-20.1 -> 19.1-28.7. So the PDL launch now needs one launch of one wave.
#        bench_dense_pdl.py again (M = 1 / 8 / 16 / 64, the run-to-run spread), then the V4-Flash decode step (4 layers)
#        at batch 1 / 8, whole-step medians, four settings alternated twice: S0 today; S1 split-K launched with PDL
#        and early reads (per-kernel sets); S2 MEGAMOE_PDL=1 (every kernel); S3 S2 + split-K early reads.
#   c -> b: the one-wave rule holds (18432x7168 and M = 64 now equal to plain); 4096x8192 M = 1 / 8 still 0.6-1.9 us
#        slower with PDL, the small shapes 0.6-1.4 us faster; the decode step's medians moved within their own
#        run-to-run spread (batch 8: 1875-2032 us for the same setting). Default stays off. The final tree's CUDA
#        tests: split-K, PDL (all), the dense layer.
#   d -> c: 149 passed. The decode-step A/B in ONE process (ab_decode_step.py: one graph per setting, replays
#        interleaved by rounds), so that a ~1% effect can show: V4-Flash 4 layers, batch 1 / 8 / 64; base, PDL on every
#        kernel, that + split-K early reads, split-K with PDL + early reads alone.
#   e -> d: one process resolves ~1.5%: PDL on every kernel +1.8% at batch 1 but -1.5% at batch 8; split-K early
#        reads nothing. The batch-8 loss fits the MoE layer's (looping decode GEMMs launched early lose 5%): with
#        pdl.PDL_ALL_GRIDS False the switch launches plainly every grid whose launcher says it loops. A/B: base,
#        PDL on every kernel, PDL on single-pass grids only; batch 1 / 8 / 32 / 64. (PDL_ALL_GRIDS and the script's
#        allgrids=0 were removed after this call: no gain. Check out 1a3101d to repeat it.)
#   f -> after the review: ab_decode_step.py and profile_decode_step.py share the model build, the prefill and the
#        step timer (profile_decode_step's random_flash_model, prefill_random, step_us): both run once, small.
#   g -> f: both failed to build the window-step kernel at --batch 1: a model of one slot passes num_slots = 1, which
#        Triton specialized into a constexpr int (no .to()). Fixed with do_not_specialize; the window-step tests
#        (new: one slot) with the fix and with it removed (a deliberate break), then ab_decode_step.py at batch 1.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v40}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format="tree: %h %s" 2>/dev/null; git status --short 2>/dev/null | head -5
case "$1" in
a)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_splitk.py \
    tests/kernels/test_pdl.py -k "splitk or pdl_chain or tiny_model or sync_free_and_graph or issue_shapes" \
    > "$OUT/a_tests.log" 2>&1
  tail -1 "$OUT/a_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/a_tests.log" | head -8
  timeout 240 python benchmarks/bench_dense_pdl.py --rows 1,2,4,8,16,64 --out "$OUT" --tag a 2>&1 | tail -32
  ;;
b)
  timeout 150 python benchmarks/bench_dense_pdl.py --rows 1,8,16,64 --out "$OUT" --tag b 2>&1 | tail -20
  S0="MEGAMOE_PDL=0"
  S1="MEGAMOE_PDL=0 MEGAMOE_PDL_LAUNCH=mma_decode,combine,splitk MEGAMOE_PDL_EARLY_READS=mma_decode,splitk"
  S2="MEGAMOE_PDL=1"
  S3="MEGAMOE_PDL=1 MEGAMOE_PDL_EARLY_READS=mma_decode,splitk"
  for run in 1 2; do
    for s in 0 1 2 3; do
      v="S$s"
      env ${!v} timeout 100 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8 --replays 1 --time 60 \
        --top 8 --tag "b_s${s}_run$run" --out /tmp/profiles 2>&1 | grep "^## batch" | sed "s/^/s$s run$run /"
    done
  done
  ;;
c)
  timeout 500 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_splitk.py \
    tests/kernels/test_pdl.py tests/layers/test_fused_projections.py tests/ops/test_gemm_dense_bf16.py \
    > "$OUT/c_tests.log" 2>&1
  tail -1 "$OUT/c_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/c_tests.log" | head -8
  ;;
d)
  # (as run, in the script's first syntax at 9c7fd54: "base|pdl=1|pdl=1,early+=splitk|launch+=splitk,early+=splitk")
  E="pdl.PDL_EARLY_READS=pdl.PDL_EARLY_READS.union({'splitk'})"
  S="base|pdl.PDL_ENABLED=True|pdl.PDL_ENABLED=True; $E|pdl.PDL_LAUNCH=pdl.PDL_LAUNCH.union({'splitk'}); $E"
  timeout 400 python benchmarks/ab_decode_step.py --layers 4 --batch 1,8,64 --settings "$S" --rounds 10 --steps 30 \
    --out "$OUT" --tag d 2>&1 | tail -30
  ;;
e)
  S="base|pdl=1|pdl=1,allgrids=0"  # the first syntax and pdl.PDL_ALL_GRIDS: run it at 1a3101d
  timeout 400 python benchmarks/ab_decode_step.py --layers 4 --batch 1,8,32,64 --settings "$S" --rounds 10 --steps 30 \
    --out "$OUT" --tag e 2>&1 | tail -30
  ;;
f)
  timeout 250 python benchmarks/profile_decode_step.py --layers 1 --batch 1 --replays 1 --time 5 --top 3 2>&1 | tail -6
  timeout 250 python benchmarks/ab_decode_step.py --layers 1 --batch 1 --rounds 2 --steps 3 2>&1 | tail -6
  ;;
g)
  timeout 60 python -m pytest -q -p no:cacheprovider tests/kvcache/test_decode_glue.py -k "matches_formula" 2>&1 | tail -1
  timeout 100 python benchmarks/ab_decode_step.py --layers 1 --batch 1 --rounds 2 --steps 3 2>&1 | tail -5
  sed -i 's/^@triton.jit(do_not_specialize=\["num_slots"\]).*/@triton.jit/' megamoe/kernels/attention_glue.py
  echo "deliberate break (do_not_specialize removed):"
  timeout 60 python -m pytest -q -p no:cacheprovider tests/kvcache/test_decode_glue.py -k "matches_formula" 2>&1 | tail -1
  ;;
esac
