#!/bin/bash
# GPU checks of 2026-11-27 (session part 17). Calls:
#   a -> the decode GEMM's L2 prefetch (issue 11; NOTES_gemm.md v25): its CUDA tests (same bits at every distance,
#        graph == eager, sync-free), then the MoE layer A/B at decode sizes (distances 0 / 3 / 6 / 12, interleaved
#        rounds, same-bits check).
#   b -> w4a8 96-row (64 + 32) tiles for the 65-96-row band (part 16's call n): the w4a8 tests, then bench_gemm.py --w4a8
#        with the default bands (64) and with MEGAMOE_W4A8_BANDS=64,96 in one call.
#   c -> w4a8 v3 (MEGAMOE_W4A8_WS=1: the two warpgroups as warp-specialized partitions meeting at the ring's mbarriers):
#        the w4a8 pipe tests (v3 == v2 bits, graph, sync-free), then bench_gemm.py --w4a8 with v2 and with v3.
#   d -> today's defaults (w4a8 with the 96-row band): the MoE layer in w4a16 and w4a8 at 4096 tokens (V4-Flash, V4-Pro),
#        and V4-Flash under uniform / Zipf / all-on-k routing at 8-4096 tokens against the bf16 layer.
#   e -> dense w4a8 GEMMs (the shared expert) on the pipelined FP8 kernel as one expert (v1 before): the w4a8 kernel, op
#        and layer tests, then the layer in w4a16 and w4a8 at 4096 / 16384 (V4-Flash) and 4096 / 8192 (V4-Pro).
#   f -> where the w4a8 layer's time goes at 4096 tokens (V4-Flash): the kernels of one replay, w4a16 and w4a8.
#   g -> w4a8 bands 64 / 96 / 128 / 192:96 (f: the > 96-row band's 128-row tiles left 129-192-row experts' second tile
#        mostly padding): the w4a8 pipe tests, the layer in w4a16 and w4a8 at 4096 / 8192, and the w4a8 probe again.
#   h -> the pipelined FP8 kernel reads 4-row interleaved weights (the layer's w4a16 layout): the w4a8 pipe tests, then
#        bench_gemm.py --w4a8 with both layouts in both modes (g's layer profile: per band the w4a8 kernels ran 0.83-0.93x
#        of the w4a16 ones, whose weights were interleaved; bench_gemm's w4a16 baseline was row-major).
#   i -> blocked dispatch (two launches of 1024 pairs per program above 2048 pairs, instead of the torch radix sort and
#        ~20 small kernels with a 60-100 us idle gap before the sort in f / g): the dispatch op tests (CUDA and the
#        interpreter-free ones), bench_dispatch.py, and the w4a16 layer probe at 4096 tokens.
#   j -> final check of the part's changes: the layer / model CUDA tests (dispatch auto = Triton at every size, the w4a8
#        paths), then the README main job on the GPU (4 layers, batch 1 and 8), and the layer benchmark (graph == eager,
#        error vs the bf16 layer) at 1 / 64 / 4096 tokens with the blocked dispatch.
# (a ran at commit 2b84f3b; its benchmark script and the L2_PREFETCH code were reverted in d3d9879. c ran at 9233618; the
#  v3 kernel and its tests were reverted after it.)
# Run with carry [".peers"]. At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v28}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 200 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_mma_l2_prefetch.py tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    > "$OUT/a_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/a_tests.log" | head; tail -1 "$OUT/a_tests.log"
  timeout 360 python benchmarks/ab_mma_l2_prefetch.py --out "$OUT" --tag a 2>&1 | tail -60 ;;
b)
  timeout 150 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py tests/kernels/gemm/test_nvfp4_w4a8.py > "$OUT/b_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/b_tests.log" | head; tail -1 "$OUT/b_tests.log"
  timeout 200 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" --tag b_w4a8_band64 2>&1 | tail -9
  MEGAMOE_W4A8_BANDS=64,96 timeout 200 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" \
    --tag b_w4a8_band96 2>&1 | tail -9 ;;
c)
  timeout 200 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py > "$OUT/c_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/c_tests.log" | head; tail -1 "$OUT/c_tests.log"
  timeout 170 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" --tag c_w4a8_v2 2>&1 | tail -9
  MEGAMOE_W4A8_WS=1 timeout 170 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" \
    --tag c_w4a8_v3 2>&1 | tail -9 ;;
d)
  timeout 230 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 4096 --modes w4a16,w4a8 \
    --out-dir "$OUT" --tag d_moe_w4a8 2>&1 | tail -6
  timeout 330 python benchmarks/bench_moe_skew.py --configs v4-flash --tokens 8,64,512,4096 \
    --out-dir "$OUT" --tag d_moe_skew_flash 2>&1 | tail -16 ;;
e)
  timeout 240 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" -n 2 \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py tests/kernels/gemm/test_nvfp4_w4a8.py \
    tests/layers/test_moe_w4a8.py > "$OUT/e_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/e_tests.log" | head; tail -1 "$OUT/e_tests.log"
  timeout 300 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 4096,8192,16384 --modes w4a16,w4a8 \
    --out-dir "$OUT" --tag e_moe_w4a8 2>&1 | tail -8 ;;
f)
  timeout 200 python benchmarks/probe_moe_decode.py --tokens 4096 --configs v4-flash --row-interleave 4 --out "$OUT" \
    --tag f_w4a16_4096 2>&1 | tail -30
  timeout 200 python benchmarks/probe_moe_decode.py --tokens 4096 --configs v4-flash --mode w4a8 --out "$OUT" \
    --tag f_w4a8_4096 2>&1 | tail -30 ;;
g)
  timeout 200 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py > "$OUT/g_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/g_tests.log" | head; tail -1 "$OUT/g_tests.log"
  timeout 240 python benchmarks/bench_moe.py --configs v4-flash,v4-pro --tokens 4096,8192 --modes w4a16,w4a8 \
    --out-dir "$OUT" --tag g_moe_w4a8 2>&1 | tail -6
  timeout 120 python benchmarks/probe_moe_decode.py --tokens 4096 --configs v4-flash --mode w4a8 --out "$OUT" \
    --tag g_w4a8_4096 2>&1 | tail -20 ;;
h)
  timeout 200 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py > "$OUT/h_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/h_tests.log" | head; tail -1 "$OUT/h_tests.log"
  timeout 300 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" --tag h_w4a8_il 2>&1 | tail -9 ;;
i)
  timeout 240 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" -n 2 \
    tests/ops/test_moe_ops.py tests/ops/test_moe_route_dispatch.py tests/ops/test_errors.py > "$OUT/i_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/i_tests.log" | head; tail -1 "$OUT/i_tests.log"
  timeout 150 python benchmarks/bench_dispatch.py --out "$OUT" 2>&1 | tail -9
  timeout 120 python benchmarks/probe_moe_decode.py --tokens 4096 --configs v4-flash --row-interleave 4 --out "$OUT" \
    --tag i_w4a16_4096 2>&1 | grep -E "^## |dispatch|radix|memset|_moe_|Fill" ;;
j)
  timeout 240 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" -n 2 \
    tests/layers/test_moe_layer.py tests/layers/test_moe_w4a8.py tests/layers/test_moe_hash_layer.py \
    tests/models/test_v4_model.py > "$OUT/j_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/j_tests.log" | head; tail -1 "$OUT/j_tests.log"
  timeout 150 python -m megamoe generate --layers 4 --batch 1,8 --steps 8 2>&1 | tail -15 | tee "$OUT/j_generate.log"
  timeout 150 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,64,4096 --out-dir "$OUT" --tag j_moe \
    2>&1 | tail -4 ;;
*) echo "usage: $0 a|b|c|d|e|f|g|h|i|j"; exit 2 ;;
esac
