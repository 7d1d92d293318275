#!/bin/bash
# GPU checks of 2026-11-27 (session part 18). Calls:
#   a -> issue 11: the decode band's L2 prefetch of the down weights (prefetch_next, the kernel's PF_NEXT;
#        NOTES_gemm.md v26): its CUDA tests, the MoE layer CUDA tests with the prefetch on (32 MB), the streaming probe
#        through the TMA engine (probe_stream_tma.py: the real read ceiling), then the layer A/B at 1-16 tokens
#        (off / 16 / 32 / 32e / 48e MB, interleaved rounds, same-bits check).
#   b -> how much of an "L2 cleared" replay is the flush's own write-back (a: every TMA ring and per-thread read stream
#        capped at 2.2-2.3 TB/s, torch copy_ 2.84): probe_l2_flush.py times the read stream, copy_, the MoE layer,
#        nvfp4_linear and the sparse attention after do_bench's zeroing flush, a reading flush and none.
#   c -> b found do_bench's zeroing flush costs the timed reads its dirty lines' write-back (117 MB read stream 2.27 ->
#        2.78 TB/s with a reading flush): the TMA probe and a's prefetch A/B again with --flush read.
#   (c's TMA probe rows were run with the write flush after all: the flush context was closed as soon as it was
#    entered, a dropped ExitStack; those two files were not kept. Fixed for d.)
#   d -> the baselines of issues 11 and 15 under both flushes, same run: the TMA probe with the read flush, the MoE
#        layer at 1 / 8 / 64 tokens (V4-Flash, V4-Pro) and the sparse attention grid with the write and the read flush.
#   e -> b-d: every read stream reaches 2.7-2.8 TB/s after a reading flush, so the decode levers measured "no gain"
#        under the zeroing flush (decode split-K, more programs) may have hit that flush's cap: the layer A/B at 1-8
#        tokens with the read flush (ab_layer_settings.py).
#   f -> the layer-level decode options measured before only under the zeroing flush (and, for the shared overlap,
#        across two processes with different routings): the shared expert on a side stream beside the router, the
#        shared expert unfused, PDL, PDL + overlap; ab_layer_settings.py with the read flush at 1-16 tokens.
#   g -> the decode band's weights through a cp.async ring (S - 1 K steps in flight instead of one in registers;
#        at 1 token the 224 programs fit at 2 per SM, so the ring's registers cost no residency there), read flush,
#        1-8 tokens; and the shared expert fused or apart at 12 / 16 tokens (f: apart 1.02-1.03x at 16, 0.91-0.98x at 8).
#   h -> g: deeper weight rings were SLOWER (0.80-0.98x), like the L2 prefetches: more bytes in flight, less
#        throughput. Is the decode's access pattern (many short runs per step) what HBM serves badly? probe_stream.py
#        with the read flush, plus the decode GEMM's own row-major and 4-row interleaved patterns.
#   i -> h: the decode's own access patterns read at 2.4-2.6 TB/s alone (2.7-2.8 with more, shorter streams), the
#        kernel at ~1.85: the kernel, not HBM, is the limit at 1 token, with ~7 warps per SM. Offline, the decode
#        config at BLOCK_N 64 under a 128-register cap builds with 127 registers and no spill (4 programs per SM:
#        448 programs at 1 token in one wave, twice the warps), and (8, 128, 256, 8) at 127 too: the layer A/B.
#   j -> i: (8, 128, 256, 8) under a 128-register cap was 1.07x at V4-Flash 1 token and 0.91-0.98x wherever its items
#        need a second round: now the decode band's config where its work items fit one wave of it
#        (one_wave_decode_config). CUDA tests (same bits as the 4-warp config, the banded route, the layer, the PDL
#        tiny-model decode), then the layer with the rule on (default) and off, read and write flush.
#   k -> j: the one-wave rule took V4-Flash 1 token 65.6 -> 61.4 us (read flush) / 73.8 -> 70.5 (write), the rest
#        unchanged (81 CUDA tests passed). Offline, (8, 128, 128, 8) builds under an 80-register cap with no K-loop
#        spill: 3 programs of 8 warps per SM, so V4-Pro's 1-token items (8 x 48) fit one wave too: A/B of that one-wave
#        config and of (8, 128, 256, 8) at 80 registers against today's, 1-4 tokens, read flush.
#   l -> final check of the part's code (the one-wave decode config is in every 1-token decode that fits it, small
#        test models included): the model, layer, op and decode-kernel CUDA tests, then the README main job on the GPU.
#   m -> the 1-token layer's kernels with the one-wave config (V4-Flash, V4-Pro), and the fused route + dispatch
#        launch's GEMV plan (experts per program, warps) at 1-4 tokens, read flush (sweep_route_plan.py).
#   n -> the shared expert fused or apart at 9-12 tokens (g: apart 1.03-1.05x at 12 / 16, 0.91-0.98x at 8), and the
#        route-plan sweep again with its output check fixed (m compared never-written dispatch buffers too).
#   o -> the shared expert fused only up to 8 tokens (FUSE_SHARED_MAX_TOKENS 16 -> 8, from f / g / n): the model and
#        layer CUDA tests, then the layer at 8-16 tokens (bench_moe, read flush).
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v29}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 150 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_mma_prefetch_next.py > "$OUT/a_tests.log" 2>&1
  MEGAMOE_DECODE_PREFETCH_NEXT_MB=32 timeout 240 python -m pytest -v -rfE --tb=short -p no:cacheprovider \
    -m "cuda and not slow" tests/layers/test_moe_layer.py >> "$OUT/a_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/a_tests.log" | head; grep -E "passed|failed" "$OUT/a_tests.log" | tail -2
  timeout 150 python benchmarks/probe_stream_tma.py --out "$OUT/a_probe_stream_tma.md" 2>&1 | tail -30
  timeout 300 python benchmarks/ab_decode_prefetch_next.py --out "$OUT" --tag a 2>&1 | tail -50 ;;
b)
  timeout 500 python benchmarks/probe_l2_flush.py --out "$OUT/b_probe_l2_flush.md" 2>&1 | tail -20 ;;
c)
  timeout 150 python benchmarks/probe_stream_tma.py --flush read --out "$OUT/c_probe_stream_tma_read.md" 2>&1 | tail -28
  timeout 300 python benchmarks/ab_decode_prefetch_next.py --flush read --tokens 1,2,4,8 --settings off,32,32e,48e \
    --out "$OUT" --tag c_read 2>&1 | tail -40 ;;
d)
  timeout 120 python benchmarks/probe_stream_tma.py --flush read --out "$OUT/d_probe_stream_tma_read.md" 2>&1 | tail -26
  for f in write read; do
    timeout 240 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 1,8,64 --flush $f --out-dir /tmp/d \
      --tag d_moe_$f 2>&1 | tail -8
    cp /tmp/d/d_moe_$f.md "$OUT/"
    timeout 200 python benchmarks/bench_attention.py --flush $f --out /tmp/d/d_attention_$f 2>&1 | tail -2
    cp /tmp/d/d_attention_$f.md "$OUT/"
  done ;;
e)
  timeout 420 python benchmarks/ab_layer_settings.py --flush read --tokens 1,2,4,8 --out "$OUT" --tag e_decode \
    --settings "base|gemm.DECODE_SPLITK=None|gemm.DECODE_SPLITK=2|mma.MMA_DECODE_CONFIGS[4]=(8,64,256,4)|gemm.DECODE_SPLITK=None; mma.DECODE_SPLITK_PROGRAMS_PER_SM=8" \
    2>&1 | tail -45 ;;
f)
  timeout 480 python benchmarks/ab_layer_settings.py --flush read --tokens 1,2,4,8,16 --out "$OUT" --tag f_layer \
    --settings "base|layer.shared_overlap=True|layer.fuse_shared_max_tokens=0|pdl.PDL_ENABLED=True|pdl.PDL_ENABLED=True; layer.shared_overlap=True" \
    2>&1 | tail -55 ;;
g)
  timeout 300 python benchmarks/ab_layer_settings.py --flush read --tokens 1,2,4,8 --out "$OUT" --tag g_ring \
    --settings "base|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,4,3)|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,4,4)|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,4,6)|mma.MMA_DECODE_CONFIGS[4]=(8,128,128,4,8)" \
    2>&1 | tail -42
  timeout 200 python benchmarks/ab_layer_settings.py --flush read --tokens 12,16 --out "$OUT" --tag g_fuse \
    --settings "base|layer.fuse_shared_max_tokens=8" 2>&1 | tail -10 ;;
h)
  timeout 200 python benchmarks/probe_stream.py --flush read --out "$OUT/h_probe_stream_read.md" 2>&1 | tail -32 ;;
i)
  timeout 400 python benchmarks/ab_layer_settings.py --flush read --tokens 1,2,4,8,16 --out "$OUT" --tag i_occupancy \
    --settings "base|mma.MMA_DECODE_CONFIGS[4]=(8,64,256,4); mma.INTERLEAVED_MAXNREG[(8,64,256,4)]=128|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,8); mma.INTERLEAVED_MAXNREG[(8,128,256,8)]=128|mma.MMA_DECODE_CONFIGS[4]=(8,64,256,2); mma.INTERLEAVED_MAXNREG[(8,64,256,2)]=128" \
    2>&1 | tail -42 ;;
j)
  timeout 300 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "cuda and not slow" \
    tests/kernels/gemm/test_nvfp4_mma_interleave.py tests/ops/test_gemm_bands.py tests/layers/test_moe_layer.py \
    tests/kernels/test_pdl.py > "$OUT/j_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/j_tests.log" | head; tail -1 "$OUT/j_tests.log"
  for f in read write; do
    timeout 200 python benchmarks/ab_layer_settings.py --flush $f --tokens 1,2,4,8 --out "$OUT" --tag j_one_wave_$f \
      --settings "base|mma.DECODE_ONE_WAVE=False" 2>&1 | tail -16
  done ;;
k)
  timeout 300 python benchmarks/ab_layer_settings.py --flush read --tokens 1,2,4 --out "$OUT" --tag k_one_wave_80 \
    --settings "base|mma.MMA_DECODE_ONE_WAVE_CONFIG=(8,128,128,8); mma.DECODE_MAXNREG[(8,128,128,8)]=80|mma.DECODE_MAXNREG[(8,128,256,8)]=80" \
    2>&1 | tail -20 ;;
l)
  timeout 420 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "cuda and not slow" tests/models \
    tests/ops/test_gemm_bands.py tests/kernels/gemm/test_nvfp4_mma_interleave.py tests/kernels/gemm/test_nvfp4_gluon.py \
    tests/kernels/gemm/test_nvfp4_decode_splitk.py > "$OUT/l_tests.log" 2>&1
  grep -E "(FAILED|ERROR)" "$OUT/l_tests.log" | head; tail -1 "$OUT/l_tests.log"
  timeout 150 python -m megamoe generate > "$OUT/l_generate.log" 2>&1; tail -8 "$OUT/l_generate.log" ;;
m)
  timeout 200 python benchmarks/probe_moe_decode.py --tokens 1 --configs v4-flash,v4-pro --row-interleave 4 --out "$OUT" --tag m \
    2>&1 | tail -24
  timeout 240 python benchmarks/sweep_route_plan.py --tokens 1,2,4 --flush read --out "$OUT/m_sweep_route_plan.md" 2>&1 \
    | tail -45 ;;
n)
  timeout 200 python benchmarks/ab_layer_settings.py --flush read --tokens 9,10,11,12 --out "$OUT" --tag n_fuse \
    --settings "base|layer.fuse_shared_max_tokens=8" 2>&1 | tail -16
  timeout 240 python benchmarks/sweep_route_plan.py --tokens 1,2,4,8 --flush read --out "$OUT/n_sweep_route_plan.md" 2>&1 \
    | tail -60 ;;
o)
  timeout 360 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "cuda and not slow" tests/models tests/layers \
    > "$OUT/o_tests.log" 2>&1
  grep -E "(FAILED|ERROR)" "$OUT/o_tests.log" | head; tail -1 "$OUT/o_tests.log"
  timeout 200 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 8,9,12,16 --flush read --out-dir /tmp/o \
    --tag o_moe_read 2>&1 | tail -10
  cp /tmp/o/o_moe_read.md "$OUT/" ;;
*) echo "usage: $0 a|b|c|d|e|f|g|h|i|j|k|l|m|n|o"; exit 2 ;;
esac
