#!/bin/bash
# GPU checks of 2026-11-27 (session part 22). Calls:
#   a -> dense linears at prefill sizes: bf16 cuBLAS on the dequantized weight beat every NVFP4 kernel route there
#        (gpu_check_v30 f: V4-Flash wo_b at 4096 rows 355 vs 515 us). New: route "dense-bf16" of nvfp4_linear (the
#        weight dequantized exactly to bf16 without its global scale, cuBLAS with the host-read global scale as alpha,
#        one call per run of the scale), taken by DenseLinear from DENSE_BF16_MIN_ROWS rows. The benchmark at 64-4096
#        rows (the route at every M, to find the crossover); its CUDA tests with the gemm op and fused projection
#        tests; the prefill profile with the route off / on (4096 tokens). The attention layer and model CUDA tests
#        follow in a later call.
#   b -> a: the route is 1.30-1.76x faster than the kernels at 4096 rows, 0.99-1.71x at 1024, 0.74-1.96x at 512, and
#        slower below; the dequantize kernel moves only ~1.6 TB/s (V4-Pro qr_proj 187 us). A row-strided out gave wrong
#        sums (~2**-9 of the partials): cuBLAS's reduced-precision split-K; now disallowed around the route's calls.
#        The CUDA tests again, with the attention layer and model tests; a config sweep of the dequantize kernel.
#   c -> b: the CUDA tests passed but for a strided out, whose sums (within the bound) differ from a contiguous out's
#        (cuBLAS picks its algorithm by ldc too: the test now bounds it instead); attention / model tests 11 passed.
#        The dequantize kernel configs are within ~5% of each other (1.2-2.1 TB/s) but for K = 1536 (512-wide tiles
#        1.3x): it is ALU-bound. New: an UNSCALED path (no global scale: exact bf16, half the integer work) for the
#        route, configs by K; the rule now 512 rows for N <= 4096, 1024 above. Tests (quantize kernels, route, gemm,
#        fused projections), the dequantize sweep (both paths), the benchmark, the prefill profile off / on.
#   d -> c: the rule takes every winning point and no losing one; prefill GPU busy -2.2% / -3.8% at 1024 / 4096
#        tokens. The route's CUDA tests again (M = 0 and a NaN in x added). Then issue 10's worst skew point: all
#        tokens on the same 6 experts at 64 tokens took 241 us against a 37 us floor (gpu_check_v28): the kernels of
#        one replay of the V4-Flash layer (row-interleaved, as the layer runs), default plan and PIPE_AFTER_DECODE=1,
#        uniform routing for comparison.
#   e -> d: at 64 tokens the layer runs the shared expert (64 rows, one expert) on the pipelined 64-row band: 16 tiles
#        of 256 columns, 43 + 24 us for ~14 MB of weights, a third of the all-on-k replay (230 us); the routed experts
#        with PIPE_AFTER_DECODE 68 vs 139 us on the mma chunks. New (opt-in, ONE_EXPERT_SPLITK_MAX_ROWS): one expert
#        with 9..max rows as 32-row mma.sync chunks with planned split-K. Its CUDA tests (the bands file's new cases,
#        the MoE layer tests with it on); the layer A/B at 9-256 tokens; the all-on-k 64 kernels with it on.
#   f -> e: the one-expert split-K plan is 1.005-1.028x on V4-Flash at 9-256 tokens, 0.987-1.006x on V4-Pro (stays
#        opt-in). The main job with a 600-token prompt (the prefill's projections take route dense-bf16), with the
#        route off and on: the sampled tokens and the timings side by side.
#   g -> f: the benchmark again with the floor column (bytes / 3.0 TB/s or FLOPs / 749 TFLOP/s).
#   h -> c, f: the prefill's wall time is host-bound (1024 tokens: 24-30 ms for 12.7 ms of kernels) whatever the
#        GEMMs gain. Where the host's Python time goes: one 1024-token prefill under cProfile.
#   i -> h: under cProfile the 1024-token prefill's Python time is 41 ms, 12.9 ms of it in Triton's launch path (167
#        launches), 10.8 ms in the pipelined kernel's launcher (68 launches: up to 7 row bands per GEMM, most of them
#        empty at prefill). The prefill with the bands above 32 rows as two tile-list launches (MEGAMOE_PIPE_LIST=1,
#        opt-in since part 15 for its GPU time) against the default, at 1024 / 4096 tokens: wall and GPU busy.
#   j -> i: PIPE_LIST saves ~4% of the 1024-token wall, within the spread at 4096 (left opt-in). The prefill's host
#        syncs: prepare_forward copied the block table from pageable memory; now a pinned snapshot, non-blocking.
#        The kvcache and model CUDA tests, and the host-sync count of one prefill (profile_prefill --host).
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v33}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 200 python benchmarks/bench_dense_prefill.py --rows 64,128,256,512,1024,4096 --flush read \
    --out "$OUT/a_dense_prefill.md" 2>&1 | tail -40
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/ops/test_gemm_dense_bf16.py tests/ops/test_gemm.py tests/layers/test_fused_projections.py > "$OUT/a_tests.log" 2>&1
  tail -3 "$OUT/a_tests.log"
  MEGAMOE_DENSE_BF16=0 timeout 100 python benchmarks/profile_prefill.py --tokens 4096 --top 12 \
    --out "$OUT/a_prefill_off.md" 2>&1 | tail -4
  timeout 100 python benchmarks/profile_prefill.py --tokens 4096 --top 12 --out "$OUT/a_prefill_on.md" 2>&1 | tail -4
  ;;
b)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/ops/test_gemm_dense_bf16.py tests/ops/test_gemm.py tests/layers/test_fused_projections.py > "$OUT/b_tests.log" 2>&1
  tail -3 "$OUT/b_tests.log"
  timeout 120 python benchmarks/sweep_dequant.py --flush read --out "$OUT/b_sweep_dequant.md" 2>&1 | tail -8
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/layers/test_attention_layer.py tests/models > "$OUT/b_tests_model.log" 2>&1
  tail -3 "$OUT/b_tests_model.log"
  ;;
c)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kernels/test_quantize_kernels.py \
    tests/ops/test_gemm_dense_bf16.py tests/ops/test_gemm.py tests/layers/test_fused_projections.py \
    > "$OUT/c_tests.log" 2>&1
  tail -3 "$OUT/c_tests.log"
  timeout 100 python benchmarks/sweep_dequant.py --flush read --out "$OUT/c_sweep_dequant.md" 2>&1 | tail -12
  timeout 150 python benchmarks/bench_dense_prefill.py --rows 256,512,1024,2048,4096 --flush read \
    --out "$OUT/c_dense_prefill.md" 2>&1 | tail -30
  MEGAMOE_DENSE_BF16=0 timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 12 \
    --out "$OUT/c_prefill_off.md" 2>&1 | grep "tokens:"
  timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --top 12 --out "$OUT/c_prefill_on.md" 2>&1 \
    | grep "tokens:"
  ;;
d)
  timeout 100 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_dense_bf16.py \
    > "$OUT/d_tests.log" 2>&1
  tail -3 "$OUT/d_tests.log"
  for r in all-on-k uniform; do
    timeout 150 python benchmarks/probe_moe_decode.py --configs v4-flash --tokens 64 --row-interleave 4 --routing $r \
      --out "$OUT" --tag "d_$r" 2>&1 | grep -E "^## |_kernel" | head -30
  done
  MEGAMOE_PIPE_AFTER_DECODE=1 timeout 150 python benchmarks/probe_moe_decode.py --configs v4-flash --tokens 64 \
    --row-interleave 4 --routing all-on-k --out "$OUT" --tag d_all-on-k_pipe_after 2>&1 | grep -E "^## |_kernel" | head -30
  ;;
e)
  timeout 120 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/ops/test_gemm_bands.py \
    -k "one_expert" > "$OUT/e_tests.log" 2>&1
  MEGAMOE_ONE_EXPERT_SPLITK_MAX_ROWS=256 timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/layers/test_moe_layer.py >> "$OUT/e_tests.log" 2>&1
  grep -E "passed|failed" "$OUT/e_tests.log"
  timeout 170 python benchmarks/ab_layer_settings.py --settings "base|gemm.ONE_EXPERT_SPLITK_MAX_ROWS=256" \
    --configs v4-flash --tokens 9,16,32,64,128,256 --rounds 2 --flush read --out "$OUT" --tag e_one_expert_flash \
    2>&1 | tail -8
  timeout 170 python benchmarks/ab_layer_settings.py --settings "base|gemm.ONE_EXPERT_SPLITK_MAX_ROWS=256" \
    --configs v4-pro --tokens 16,64,256 --rounds 2 --flush read --out "$OUT" --tag e_one_expert_pro 2>&1 | tail -5
  MEGAMOE_ONE_EXPERT_SPLITK_MAX_ROWS=256 timeout 100 python benchmarks/probe_moe_decode.py --configs v4-flash \
    --tokens 64 --row-interleave 4 --routing all-on-k --out "$OUT" --tag e_all-on-k_one_expert 2>&1 | grep -E "^## "
  ;;
f)
  MEGAMOE_DENSE_BF16=0 timeout 200 python -m megamoe generate --layers 4 --batch 1,8 --prompt-len 600 --steps 16 \
    > "$OUT/f_generate_off.log" 2>&1
  tail -4 "$OUT/f_generate_off.log"
  timeout 200 python -m megamoe generate --layers 4 --batch 1,8 --prompt-len 600 --steps 16 > "$OUT/f_generate_on.log" 2>&1
  tail -4 "$OUT/f_generate_on.log"
  ;;
g)
  timeout 200 python benchmarks/bench_dense_prefill.py --rows 256,512,1024,2048,4096 --flush read \
    --out "$OUT/g_dense_prefill.md" 2>&1 | tail -30
  ;;
h)
  timeout 200 python benchmarks/profile_prefill.py --tokens 1024 --top 40 --cprofile \
    --out "$OUT/h_prefill_cprofile.md" 2>&1 | tail -50
  ;;
i)
  for list in 0 1 0 1; do
    MEGAMOE_PIPE_LIST=$list timeout 100 python benchmarks/profile_prefill.py --tokens 1024,4096 --repeats 5 --top 8 \
      --out "$OUT/i_prefill_list$list.md" 2>&1 | grep "tokens:" | sed "s/^/list $list: /"
  done
  ;;
j)
  timeout 330 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kvcache tests/models \
    > "$OUT/j_tests.log" 2>&1
  tail -3 "$OUT/j_tests.log"
  timeout 120 python benchmarks/profile_prefill.py --tokens 1024 --top 12 --host --out "$OUT/j_prefill_host.md" 2>&1 \
    | grep -E "tokens:|syncs" -A4 | head -20
  ;;
esac
