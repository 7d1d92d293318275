#!/usr/bin/env bash
# NOT RUN yet (written 2026-11-23 part 5, a session without device time). Three parts, one device call each
# (each < 10 min); run "tests" first. Peer runs need carry=[".peers"] and MEGAMOE_PEERS=$PWD/.peers.
#   tests: PDL + x ring + shared overlap + EP (world 1, NCCL) CUDA tests, then the PDL A/B (gpu_check_v14's)
#   moe:   the MoE layer at 1/8/16 tokens: today, shared overlap, PDL, both; V4-Pro alone
#   gemm:  the wgmma x ring vs today (banded route), the peer with and without it, the dense linears again
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v15}
mkdir -p "$OUT"
part=${1:-tests}
if [ "$part" = tests ]; then
  timeout 420 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/kernels/test_pdl.py \
    tests/kernels/gemm/test_nvfp4_wgmma_x_ring.py tests/layers/test_moe_layer.py tests/distributed/test_ep_generate.py \
    tests/distributed/test_ep_moe_cuda.py 2>&1 | grep -v "^\s*$" | tail -15 | tee "$OUT/gpu_tests.txt"
  timeout 150 python benchmarks/bench_pdl.py --tokens 1,8 --out "$OUT/pdl_v2" 2>&1 | grep -v Warn | tail -14
elif [ "$part" = moe ]; then
  for v in "base:" "overlap:--shared-overlap"; do
    name=${v%%:*}; flag=${v#*:}
    timeout 100 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 $flag --out-dir "$OUT" \
      --tag "moe_${name}" 2>&1 | grep "^| deepseek" | tee -a "$OUT/moe_summary.txt"
    MEGAMOE_PDL=1 timeout 100 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 $flag --out-dir "$OUT" \
      --tag "moe_${name}_pdl" 2>&1 | grep "^| deepseek" | tee -a "$OUT/moe_summary.txt"
  done
  timeout 120 python benchmarks/bench_moe.py --configs v4-pro --tokens 1,8 --out-dir "$OUT" --tag moe_pro 2>&1 \
    | grep "^| deepseek" | tee -a "$OUT/moe_summary.txt"
elif [ "$part" = gemm ]; then
  timeout 180 python benchmarks/bench_wgmma_x_ring.py --out-dir "$OUT" 2>&1 | grep -v Warn | tail -8
  for ring in 0 4; do
    MEGAMOE_WGMMA_X_RING=$ring timeout 150 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,4096 \
      --routings uniform --no-bf16 --out-dir "$OUT" --tag "peer_x_ring_$ring" 2>&1 | grep -v Warn | tail -6
  done
  timeout 120 python benchmarks/bench_gemm.py --dense-splitk --rep-ms 20 --tag gemm_dense_v15 --out-dir "$OUT" 2>&1 \
    | grep -v Warn | tail -4
fi
