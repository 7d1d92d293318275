# GPU check v23 (2026-11-26, part 12): the pipelined kernel's tail tiles (issue 10, NOTES_gemm.md v20).
#   a -> kernel-alone A/B (96 vs 128-row tiles; 48 vs 64), the layer vs the peer with PIPE_TAIL off / on (V4-Flash
#        2048 / 4096, V4-Pro 4096; uniform, Zipf), the CUDA tests of the pipelined kernel and the band planner.
#   b -> the 96-row tile with 4 vs 5 ring stages (kernel alone), then the layer with PIPE_TAIL off / on over more
#        points (V4-Flash 2048-16384, V4-Pro 4096 / 8192; uniform, Zipf, all-on-k; the peer was not found: 10 ms reps)
#   c -> the layer vs the peer with PIPE_TAIL off / on, 60 ms of replays per point (V4-Flash and V4-Pro, 2048-8192).
#   d -> with the 129-192-row band (two 96-row tiles): kernel alone 128 vs 96-row tiles at 129 / 192 rows per expert,
#        the 64-row band at 4 vs 6 stages; the layer vs the peer (V4-Pro 8192, V4-Flash 8192); the CUDA tests of the
#        pipelined kernel, the bands, the grouped op and the MoE layer with PIPE_TAIL on (the default now).
#   e -> the "+disp" columns of c / d at V4-Pro 8192 varied by up to 30%: the same points with 400 ms of replays
#        (no peer), V4-Pro 8192 and V4-Flash 4096 uniform, PIPE_TAIL off / on, twice.
#   f -> the MMA-K-order copy with contiguous loads (bench_mma_k_order.py, the first version beside it), its CUDA
#        test, then the layer points of e again and the profile of probe_dispatch_cost.py.
#   g -> the fused route at 8-16 tokens with one program per expert (SPLIT_H_MIN_TOKENS 64, FUSED_ROUTE_MAX_TOKENS 16):
#        CUDA tests of the route / router / MoE layer, bench_route, bench_moe (V4-Flash 1-64 tokens), the V4-Pro probe.
#   h -> the dispatch as one sort, the router logits' small-T config: bench_dispatch, bench_router_logits, the CUDA
#        tests of dispatch / router / MoE ops / PDL.
# Run with carry [".peers"] (the peer). At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v23}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 150 python benchmarks/ab_pipe_tail.py --out "$OUT" 2>&1 | tail -8
  timeout 190 python benchmarks/bench_peer.py --configs v4-flash --tokens 2048,4096 --routings uniform,zipf --both-tail \
    --no-bf16 --rep-ms 10 --budget-s 150 --out-dir "$OUT" --tag peer_tail_flash 2>&1 | grep -v "^  " | tail -12
  timeout 110 python benchmarks/bench_peer.py --configs v4-pro --tokens 4096 --routings uniform --both-tail \
    --no-bf16 --rep-ms 10 --budget-s 80 --out-dir "$OUT" --tag peer_tail_pro 2>&1 | grep -v "^  " | tail -6
  timeout 160 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    tests/ops/test_gemm_bands.py > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log" ;;
b)
  timeout 100 python benchmarks/ab_pipe_tail.py --out "$OUT" --tokens 4096 --tail-stages 5 2>&1 | tail -4
  timeout 300 python benchmarks/bench_peer.py --configs v4-flash --tokens 2048,4096,16384 --routings uniform,zipf,all-on-k \
    --both-tail --no-bf16 --rep-ms 10 --budget-s 260 --out-dir "$OUT" --tag peer_tail_flash_b 2>&1 | grep -v "^  " | tail -14
  timeout 170 python benchmarks/bench_peer.py --configs v4-pro --tokens 4096,8192 --routings uniform,zipf --both-tail \
    --no-bf16 --rep-ms 10 --budget-s 120 --out-dir "$OUT" --tag peer_tail_pro_b 2>&1 | grep -v "^  " | tail -8 ;;
c)
  timeout 280 python benchmarks/bench_peer.py --configs v4-flash --tokens 2048,4096 --routings uniform,zipf --both-tail \
    --no-bf16 --rep-ms 60 --budget-s 240 --out-dir "$OUT" --tag peer_tail_flash_c 2>&1 | grep -v "^  " | tail -9
  timeout 280 python benchmarks/bench_peer.py --configs v4-pro --tokens 4096,8192 --routings uniform,zipf --both-tail \
    --no-bf16 --rep-ms 60 --budget-s 220 --out-dir "$OUT" --tag peer_tail_pro_c 2>&1 | grep -v "^  " | tail -9 ;;
d)
  P1="5504:128,256,128,8,4:96,256,128,8,4;8192:128,256,128,8,4:96,256,128,8,4;2048:64,256,128,8,4:64,256,128,8,6"
  timeout 150 python benchmarks/ab_pipe_tail.py --out "$OUT" --pairs "$P1" --tag d 2>&1 | tail -7
  timeout 200 python benchmarks/bench_peer.py --configs v4-pro --tokens 8192 --routings uniform,zipf --both-tail \
    --no-bf16 --rep-ms 60 --budget-s 170 --out-dir "$OUT" --tag peer_tail_pro_d 2>&1 | grep -v "^  " | tail -4
  timeout 120 python benchmarks/bench_peer.py --configs v4-flash --tokens 8192 --routings uniform --both-tail \
    --no-bf16 --rep-ms 60 --budget-s 90 --out-dir "$OUT" --tag peer_tail_flash_d 2>&1 | grep -v "^  " | tail -3
  timeout 200 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    tests/ops/test_gemm_bands.py tests/ops/test_gemm.py tests/layers/test_moe_layer.py > "$OUT/tests_d.log" 2>&1
  tail -3 "$OUT/tests_d.log" ;;
e)
  for run in 1 2; do
    timeout 140 python benchmarks/bench_peer.py --configs v4-pro --tokens 8192 --routings uniform --both-tail --no-peer \
      --no-bf16 --rep-ms 400 --budget-s 100 --out-dir "$OUT" --tag peer_tail_pro_e$run 2>&1 | grep "deepseek" | tail -1
    timeout 100 python benchmarks/bench_peer.py --configs v4-flash --tokens 4096 --routings uniform --both-tail --no-peer \
      --no-bf16 --rep-ms 400 --budget-s 60 --out-dir "$OUT" --tag peer_tail_flash_e$run 2>&1 | grep "deepseek" | tail -1
  done ;;
f)
  timeout 120 python benchmarks/bench_mma_k_order.py --out "$OUT" 2>&1 | tail -5
  timeout 100 python -m pytest -q -m cuda -p no:cacheprovider tests/kernels/gemm/test_mma_k_order.py 2>&1 | tail -1
  timeout 140 python benchmarks/bench_peer.py --configs v4-pro --tokens 8192 --routings uniform --both-tail --no-peer \
    --no-bf16 --rep-ms 400 --budget-s 100 --out-dir "$OUT" --tag peer_tail_pro_f 2>&1 | grep "deepseek" | tail -1
  timeout 100 python benchmarks/bench_peer.py --configs v4-flash --tokens 4096 --routings uniform --both-tail --no-peer \
    --no-bf16 --rep-ms 400 --budget-s 60 --out-dir "$OUT" --tag peer_tail_flash_f 2>&1 | grep "deepseek" | tail -1
  mkdir -p /tmp/probe && timeout 150 python benchmarks/probe_dispatch_cost.py --out /tmp/probe 2>&1 | grep "us" | head -8
  cp /tmp/probe/probe_dispatch_cost.md "$OUT/probe_dispatch_cost_f.md" ;;
g)
  timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_moe_route_dispatch.py \
    tests/kernels/test_router_logits.py tests/layers/test_moe_layer.py tests/ops/test_moe_ops.py \
    > "$OUT/tests_g.log" 2>&1; tail -1 "$OUT/tests_g.log"
  timeout 100 python benchmarks/bench_route.py --tokens 1,8,16,32 --out "$OUT/route_g.md" 2>&1 | grep "^| v4"
  timeout 200 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16,64 --out-dir "$OUT" --tag moe_g \
    2>&1 | tail -3
  timeout 150 python benchmarks/probe_moe_decode.py --tokens 1,8,16 --configs v4-pro --out "$OUT" 2>&1 | grep "^## " ;;
h)
  timeout 100 python benchmarks/bench_dispatch.py --out "$OUT" 2>&1 | grep "^| [0-9]"
  timeout 250 python benchmarks/bench_router_logits.py --out "$OUT" 2>&1 | grep "^| V4"
  timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_moe_ops.py tests/kernels/test_router_logits.py \
    tests/ops/test_moe_op_validation.py tests/kernels/test_pdl.py tests/ops/test_errors.py > "$OUT/tests_h.log" 2>&1
  tail -1 "$OUT/tests_h.log" ;;
esac
ls "$OUT"
