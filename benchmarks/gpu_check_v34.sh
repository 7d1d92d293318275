#!/bin/bash
# GPU checks of 2026-11-27 (session part 23). Calls:
#   a -> the shared expert apart (9-256 tokens) ran as a grouped GEMM of one expert: at 64 tokens 16 tiles of 256
#        columns on 132 SMs, 43 + 24 us for ~14 MB (gpu_check_v33 d). New: its GEMMs as dense split-K GEMMs where the
#        split-K route takes the shape (nvfp4_linear; gate_up with activation="swiglu", the SwiGLU in the split-K
#        reduction; moe.SHARED_SPLITK, default on). The shared expert alone on / off against bf16 and the floor; the
#        CUDA tests of the split-K kernel, the gemm ops and the MoE layer.
#   b -> a: the shared expert alone is 1.50-2.84x faster on V4-Flash (9-256 tokens) and 1.18-2.32x on V4-Pro, but
#        16-35% of its floor, and slower than the bf16 FFN from 128 tokens (V4-Flash 70 vs 38 us), where its down GEMM
#        (K = 2048 / 3072, split-K only to 64 rows) still runs grouped; 142 CUDA tests passed. The benchmark again with
#        split-K's class bound raised to 256 rows (is split-K the faster down GEMM there?); the MoE layer A/B (split-K
#        shared expert on / off, and apart at 4 / 8 tokens instead of fused).
#   c -> b: the layer 1.033-1.055x faster on V4-Flash at 9-128 tokens with the split-K shared expert, 1.011-1.027x on
#        V4-Pro; fused still wins at 4 / 8 tokens (apart 0.89-0.96x). With split-K's class bound at 256 rows the shared
#        expert at 128 / 256 tokens gains again (V4-Flash 69.5 -> 44.4, 83.6 -> 69.8 us). Before moving the dense
#        rule: the split-K kernel against the route the op takes today on the two down shapes (4096 x 2048, 7168 x
#        3072) at 64-256 rows, and the all-on-k 64-token layer's kernels (was 230.5 us).
#   d -> c: split-K beats the tensor-core route at 96 / 128 rows on both down shapes (1.6-1.9x), even or behind at
#        192 / 256: new tier DENSE_SPLITK_MID_K (2048 <= K < 4096: split-K to 128 rows). All-on-k 64 tokens 230.5 ->
#        180.1 us (the shared expert 24.5 us; the routed mma chunks 93.6 + 45.5). The shared expert on the opt-in
#        side stream keeps its grouped GEMMs (split-K's single-launch reduction shares the device's tile counters).
#        CUDA tests (split-K, MoE layer, models); the shared expert alone; the main job at batch 16 / 64 (shared
#        expert apart) with SHARED_SPLITK off / on.
#   e -> d: 141 CUDA tests passed; the main job's decode 3.24 -> 3.02 ms per token at batch 16, 6.32 -> 5.89 at 64.
#        From 128 tokens the bf16 FFN beats the split-K shared expert, and at prefill sizes the shared expert runs the
#        pipelined kernel as one expert. New: the shared expert's GEMMs on route "dense-bf16" from its row threshold
#        (moe.SHARED_DENSE_BF16; gate_up: cuBLAS's float32 product, then a scaled-SwiGLU kernel, swiglu_rows.py).
#        CUDA tests (the SwiGLU kernel, the route, the MoE layer, models); the shared expert alone at 128-4096
#        tokens with the route forced at every size; the prefill profile with MEGAMOE_SHARED_DENSE_BF16=0 / default.
#   f -> e: the shared expert alone on the route 1.11-1.57x at 512-4096 tokens (V4-Flash 4096: 419.8 -> 321.8 us, 86%
#        of its floor; V4-Pro 1.27-1.31x from 1024), 31 CUDA tests passed, but the prefill's GPU time did not move:
#        the model's gate/up come from separately scaled checkpoint parts, whose interleaved global scale alternates
#        row by row (more runs than HOST_SCALE_MAX_SEGMENTS: no host copy, no route). New: host_global_scale(...,
#        device_scale_ok=True) for the SwiGLU variant (it applies the scale on the device). CUDA tests; the prefill
#        profile again off / on.
#   g -> f: prefill GPU busy 32621 -> 32103 us at 4096 tokens, even at 1024; 23 CUDA tests passed. The SwiGLU clamp
#        and silu now one Triton helper (nvfp4_gemm.swiglu_clamped) for the split-K reduction, the tensor-core and
#        W4A8 kernels; the two shared-expert layer tests one parametrized test. Their CUDA tests.
#   h -> g: 99 CUDA tests passed. From b / c: the shared expert's down at 129-511 rows ran grouped (~49 / 64 us at 256
#        rows on V4-Flash / V4-Pro) where nvfp4_linear's tensor-core route takes ~30 / 45 us. New: the down on
#        nvfp4_linear below DENSE_PIPE_MIN_ROWS (SHARED_SPLITK). The shared expert alone at 128-384 tokens; the MoE
#        layer's shared-expert CUDA tests.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v34}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null
case "$1" in
a)
  timeout 200 python benchmarks/bench_shared_expert.py --tokens 9,16,32,64,128,256 --flush read \
    --out "$OUT/a_shared_expert.md" 2>&1 | tail -20
  timeout 330 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/kernels/gemm/test_nvfp4_splitk.py tests/ops/test_gemm.py tests/layers/test_moe_layer.py > "$OUT/a_tests.log" 2>&1
  tail -3 "$OUT/a_tests.log"
  ;;
b)
  timeout 200 python benchmarks/bench_shared_expert.py --tokens 9,16,32,64,128,256 --class-rows 256 --flush read \
    --out "$OUT/b_shared_expert.md" 2>&1 | tail -18
  timeout 380 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 4,8,9,16,64,128 \
    --settings "base|moe.SHARED_SPLITK=False|layer.fuse_shared_max_tokens=0" --out "$OUT" --tag b_shared 2>&1 | tail -40
  ;;
c)
  timeout 300 python benchmarks/bench_gemm.py --dense-splitk --splitk-shapes 4096x2048,7168x3072 \
    --splitk-rows 64,96,128,192,256 --out-dir "$OUT" --tag c_dense_splitk 2>&1 | grep "^N=" | tail -12
  timeout 200 python benchmarks/probe_moe_decode.py --configs v4-flash --tokens 64 --row-interleave 4 \
    --routing all-on-k --out "$OUT" --tag c_all-on-k 2>&1 | tail -4
  ;;
d)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/kernels/gemm/test_nvfp4_splitk.py tests/layers/test_moe_layer.py tests/models > "$OUT/d_tests.log" 2>&1
  tail -3 "$OUT/d_tests.log"
  timeout 100 python benchmarks/bench_shared_expert.py --tokens 9,64,128,256 --flush read \
    --out "$OUT/d_shared_expert.md" 2>&1 | grep "^| v4"
  MEGAMOE_SHARED_SPLITK=0 timeout 80 python -m megamoe generate --layers 4 --batch 16,64 --steps 16 \
    > "$OUT/d_generate_off.log" 2>&1
  grep "decode" "$OUT/d_generate_off.log"
  timeout 80 python -m megamoe generate --layers 4 --batch 16,64 --steps 16 > "$OUT/d_generate_on.log" 2>&1
  grep "decode" "$OUT/d_generate_on.log"
  ;;
e)
  timeout 330 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_swiglu_rows.py \
    tests/ops/test_gemm_dense_bf16.py tests/layers/test_moe_layer.py tests/models > "$OUT/e_tests.log" 2>&1
  tail -3 "$OUT/e_tests.log"
  timeout 150 python benchmarks/bench_shared_expert.py --tokens 128,256,512,1024,2048,4096 --force-bf16 --flush read \
    --out "$OUT/e_shared_expert.md" 2>&1 | grep "^| v4"
  MEGAMOE_SHARED_DENSE_BF16=0 timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 12 \
    --out "$OUT/e_prefill_off.md" 2>&1 | grep "tokens:"
  timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 12 --out "$OUT/e_prefill_on.md" 2>&1 \
    | grep "tokens:"
  ;;
f)
  timeout 250 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_dense_bf16.py \
    tests/layers/test_moe_layer.py > "$OUT/f_tests.log" 2>&1
  tail -3 "$OUT/f_tests.log"
  MEGAMOE_SHARED_DENSE_BF16=0 timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 14 \
    --out "$OUT/f_prefill_off.md" 2>&1 | grep "tokens:"
  timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 14 --out "$OUT/f_prefill_on.md" 2>&1 \
    | grep "tokens:"
  ;;
g)
  timeout 400 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_gemm.py \
    tests/kernels/gemm/test_nvfp4_w4a8.py tests/kernels/gemm/test_swiglu_rows.py tests/ops/test_gemm_dense_bf16.py \
    tests/layers/test_moe_layer.py tests/kernels/gemm/test_nvfp4_splitk.py -k "not issue_shapes" > "$OUT/g_tests.log" 2>&1
  tail -3 "$OUT/g_tests.log"
  ;;
h)
  timeout 100 python benchmarks/bench_shared_expert.py --tokens 128,192,256,384 --flush read \
    --out "$OUT/h_shared_expert.md" 2>&1 | grep "^| v4"
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/layers/test_moe_layer.py \
    > "$OUT/h_tests.log" 2>&1
  tail -3 "$OUT/h_tests.log"
  ;;
esac
