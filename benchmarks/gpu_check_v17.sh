#!/usr/bin/env bash
# NOT RUN yet (written 2026-11-25 after gpu_check_v16; the session's device time was spent). One GPU, one call
# per part (< 10 min each): `bash benchmarks/gpu_check_v17.sh` runs 1-4, `bash benchmarks/gpu_check_v17.sh ncu` runs 5-6.
#   1. pdl_bisect --trace --history: with capture_decode's fix (step.sampled kept) no step may be corrupted;
#      if one is, --history names the block's previous owner
#   2. the graph tests that read tokens right after a replay (test_pdl's tiny model, the new free-running test)
#   3. V4-Pro layer on 80 GB (bench_moe now skips the bf16 baseline when it does not fit)
#   4. x smem on the 32-row band between 512 and 2048 tokens (does it earn a default for a token range?)
#   5. issue 10: ncu stall breakdown, our banded route vs the peer at 4096 tokens (carry=[".peers"])
#   6. issue 11: the dense split-K route up to 256 rows for K >= 4096 (tests, then the dense sweep's "op route")
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v17}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "${1:-main}" = main ]; then
  timeout 150 python benchmarks/pdl_bisect.py --trace --history --repeats 4 > "$OUT/graph_trace.log" 2>&1
  grep -v "^\s*$" "$OUT/graph_trace.log" | tail -30
  timeout 150 python -m pytest -q -p no:cacheprovider -m cuda --tb=line tests/kernels/test_pdl.py \
    tests/models/test_v4_model.py -k "tiny_model or graph" 2>&1 | tail -4 | tee "$OUT/graph_tests.txt"
  timeout 120 python benchmarks/bench_moe.py --configs v4-pro --tokens 1,8 --out-dir "$OUT" --tag moe_pro 2>&1 \
    | grep "^| deepseek\|does not fit"
  timeout 150 python benchmarks/bench_x_operand.py --tokens 640,768,1024,1536,2048 --out-dir "$OUT" \
    --tag x_operand_band32 2>&1 | grep -v Warn | tail -22
else
  # 5. issue 10: Nsight Compute stall breakdown of our banded route vs the peer at 4096 tokens (needs carry=[".peers"]
  #    and MEGAMOE_PEERS=$PWD/.peers); the CSV comes back whole, the summary lines here
  MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers} timeout 200 ncu --kernel-name regex:'nvfp4_wgmma|nvfp4_mma_decode|matmul_ogs' \
    --launch-count 12 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
    python benchmarks/probe_prefill_ncu.py --tokens 4096 --calls 1 > "$OUT/prefill_ncu.csv" 2> "$OUT/prefill_ncu.err"
  grep -c . "$OUT/prefill_ncu.csv"; tail -3 "$OUT/prefill_ncu.err"
  # 6. issue 11: the dense route's split-K bound raised to 256 rows for K >= 4096 (NOTES_gemm.md, after v13)
  timeout 150 python -m pytest -q -p no:cacheprovider -m cuda --tb=line tests/kernels/gemm/test_nvfp4_splitk.py 2>&1 \
    | tail -3 | tee "$OUT/splitk_tests.txt"
  timeout 90 python benchmarks/bench_gemm.py --dense-splitk --rep-ms 20 --tag gemm_dense_v17 --out-dir "$OUT" 2>&1 \
    | grep -v Warn | tail -4
fi
