# GPU check v19 (2026-11-26): the pipelined wgmma kernel (NOTES_gemm.md v17).
#   bash benchmarks/gpu_check_v19.sh tests   -> CUDA tests of the kernel and of the routes it joins
#   bash benchmarks/gpu_check_v19.sh flash   -> ours (PIPE_ROUTE off / on) vs the peer and bf16, V4-Flash
#   bash benchmarks/gpu_check_v19.sh pro     -> the same, V4-Pro
#   bash benchmarks/gpu_check_v19.sh bands   -> band tests; V4-Flash: previous commit, PIPE_BANDS off / on, the peer
#   bash benchmarks/gpu_check_v19.sh skew    -> the MoE layer under skewed routing, PIPE_ROUTE on / off (bench_moe_skew)
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu_check_v19}
mkdir -p "$OUT"
case "$1" in
tests)
  timeout 300 python -m pytest -q -m cuda tests/kernels/gemm/test_nvfp4_wgmma_pipe.py tests/kernels/gemm/test_mma_k_order.py \
    tests/kernels/gemm/test_nvfp4_wgmma_x_ring.py tests/kernels/gemm/test_nvfp4_mma_x_smem.py 2>&1 | tail -4 | tee "$OUT/a_pipe_tests.log"
  timeout 300 python -m pytest -q -m cuda tests/ops/test_gemm_bands.py tests/ops/test_gemm.py tests/layers/test_moe_layer.py \
    tests/kernels/gemm/test_nvfp4_wgmma_ws.py 2>&1 | tail -4 | tee "$OUT/a_pipe_route_tests.log" ;;
flash)
  MEGAMOE_PEERS=.peers timeout 560 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,1024,4096,16384 \
    --routings uniform,zipf,all-on-k --both-pipe --rep-ms 10 --budget-s 480 --out-dir "$OUT" --tag b_peer_pipe_flash \
    2>&1 | grep -v Warning | grep "tok:\|done\|Error" ;;
pro)
  MEGAMOE_PEERS=.peers timeout 400 python benchmarks/bench_peer.py --configs v4-pro --tokens 512,2048,4096,8192 \
    --routings uniform,zipf,all-on-k --both-pipe --rep-ms 10 --budget-s 330 --out-dir "$OUT" --tag c_peer_pipe_pro \
    2>&1 | grep -v Warning | grep "tok:\|done\|Error" ;;
bands)
  # A/B in one call: .ab/old = the previous commit's package (git archive HEAD, carried by the device run: its
  # pipelined kernel without the cross-tile refill), then this tree with PIPE_BANDS off and on
  timeout 200 python -m pytest -q -m cuda tests/kernels/gemm/test_nvfp4_wgmma_pipe.py tests/ops/test_gemm_bands.py \
    2>&1 | tail -3 | tee "$OUT/e_bands_tests.log"
  ARGS=${ARGS:-"--configs v4-flash --tokens 512,1024,2048,4096,16384 --routings uniform,zipf,all-on-k --rep-ms 10 --no-bf16"}
  if [ -d .ab/old ]; then
    (cd .ab/old && MEGAMOE_PEERS=../../.peers timeout 200 python benchmarks/bench_peer.py $ARGS --out-dir "$OUT" \
      --tag f_peer_pipe_old 2>&1 | grep -v Warning | grep "tok:\|done\|Error")
  fi
  MEGAMOE_PEERS=.peers timeout 200 python benchmarks/bench_peer.py $ARGS --out-dir "$OUT" --tag f_peer_pipe_top \
    2>&1 | grep -v Warning | grep "tok:\|done\|Error"
  MEGAMOE_PIPE_BANDS=1 MEGAMOE_PEERS=.peers timeout 200 python benchmarks/bench_peer.py $ARGS --out-dir "$OUT" \
    --tag f_peer_pipe_bands 2>&1 | grep -v Warning | grep "tok:\|done\|Error" ;;
skew)
  for pipe in 1 0; do
    MEGAMOE_PIPE_ROUTE=$pipe timeout 200 python benchmarks/bench_moe_skew.py --configs v4-flash --tokens 64,512,2048,4096 --rep-ms 15 \
      --out-dir "$OUT" --tag d_moe_skew_pipe$pipe 2>&1 | grep "tokens:"
  done ;;
esac
# final validation (H100): bash benchmarks/gpu_check_v19.sh final-tests | final-flash | final-pro | final-skew
case "$1" in
final-tests)
  timeout 560 python -m pytest -q -m cuda tests/kernels/gemm tests/ops/test_gemm.py tests/ops/test_gemm_bands.py \
    tests/layers/test_moe_layer.py 2>&1 | tail -4 | tee "$OUT/z_tests.log" ;;
final-flash)
  MEGAMOE_PEERS=.peers timeout 560 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,1024,2048,4096,16384 \
    --routings uniform,zipf,all-on-k --both-pipe --rep-ms 10 --budget-s 500 --out-dir "$OUT" --tag z_peer_flash \
    2>&1 | grep -v Warning | grep "tok:\|done\|Error" ;;
final-pro)
  MEGAMOE_PEERS=.peers timeout 560 python benchmarks/bench_peer.py --configs v4-pro --tokens 512,2048,4096,8192 \
    --routings uniform,zipf,all-on-k --both-pipe --rep-ms 10 --budget-s 480 --out-dir "$OUT" --tag z_peer_pro \
    2>&1 | grep -v Warning | grep "tok:\|done\|Error\|skip" ;;
final-skew)
  for pipe in 1 0; do
    MEGAMOE_PIPE_ROUTE=$pipe timeout 250 python benchmarks/bench_moe_skew.py --configs v4-flash --tokens 8,64,512,2048,4096 \
      --rep-ms 15 --out-dir "$OUT" --tag z_moe_skew_pipe$pipe 2>&1 | grep "tokens:"
  done ;;
esac
