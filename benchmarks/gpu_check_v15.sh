#!/usr/bin/env bash
# NOT RUN yet (written 2026-11-23 part 5, a session without device time). Three parts, one device call each
# (each < 10 min); run "tests" first. Peer runs need carry=[".peers"] and MEGAMOE_PEERS=$PWD/.peers.
#   tests: PDL + x ring + x smem + shared overlap + EP (world 1, NCCL) CUDA tests, then the PDL A/B (v14's)
#   moe:   the MoE layer at 1/8/16 tokens: today, shared overlap, PDL, both; V4-Pro alone
#   gemm:  x-operand staging (wgmma x ring, mma x smem) vs today, the peer beside both, the dense linears again
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v15}
mkdir -p "$OUT"
part=${1:-tests}
if [ "$part" = tests ]; then
  timeout 420 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/kernels/test_pdl.py \
    tests/kernels/gemm/test_nvfp4_wgmma_x_ring.py tests/kernels/gemm/test_nvfp4_mma_x_smem.py \
    tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_wgmma_sync_free_and_graph tests/layers/test_moe_layer.py \
    tests/distributed/test_ep_generate.py \
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
  timeout 240 python benchmarks/bench_x_operand.py --out-dir "$OUT" 2>&1 | grep -v Warn | tail -34
  # the peer beside today, then beside the x ring + x smem (both opt-in switches on)
  timeout 150 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,4096 --routings uniform --no-bf16 \
    --out-dir "$OUT" --tag peer_today 2>&1 | grep -v Warn | tail -6
  MEGAMOE_WGMMA_X_RING=4 MEGAMOE_MMA_X_SMEM=32 timeout 150 python benchmarks/bench_peer.py --configs v4-flash \
    --tokens 512,4096 --routings uniform --no-bf16 --out-dir "$OUT" --tag peer_x_operand 2>&1 | grep -v Warn | tail -6
  timeout 120 python benchmarks/bench_gemm.py --dense-splitk --rep-ms 20 --tag gemm_dense_v15 --out-dir "$OUT" 2>&1 \
    | grep -v Warn | tail -4
fi
