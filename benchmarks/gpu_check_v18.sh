#!/usr/bin/env bash
# 2026-11-25 (session 7). One GPU. `bash benchmarks/gpu_check_v18.sh a` (carry=[".peers"]):
#   1. a fresh decode-step profile (4 layers, batch 1 / 8 / 64): where a token's time goes today
#   2. issue 10: stall reasons (ncu metrics) of today's wgmma route, the x ring and x smem variants, and the peer,
#      at 4096 tokens: does moving x to cp.async lower the L1/TEX load (72% busy in gpu_check_v17)?
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v18}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/device.txt"
# `bash benchmarks/gpu_check_v18.sh b`: issue 15, ncu of the sparse attention (WS kernel and its combine) at CSA
#   batch 128 / 32, 32k context, plus the same with MEGAMOE_ATTN_WS=0 (no overlap) and impl v1 for contrast
# `bash benchmarks/gpu_check_v18.sh c`: issue 15, S_REPLICATED (both consumer warpgroups compute the whole score tile,
#   no cross-warpgroup softmax exchange): validation + timing with MEGAMOE_ATTN_S_REPLICATED=1, today's timing beside it
# `bash benchmarks/gpu_check_v18.sh d` (< 7 min): the helpers' work of this session, trimmed to the device time left:
#   MegaMoE v1 (issue 11) CUDA tests + V4-Flash bench at 1/2/4/8/16 tokens; the fused attention projections' CUDA
#   tests + the batch-1 decode-step profile; the GPU failure of test_hc_post_pre_equals_unfused[17-72] with its traceback
part=${1:-a}
if [ "$part" = a ]; then
  timeout 240 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8,64 --out "$OUT" > "$OUT/profile.log" 2>&1
  grep -v Warn "$OUT/profile.log" | grep "^## \|^| \`" | head -40
  STALLS=$(for s in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait \
      not_selected selected dispatch_stall no_instruction imc_miss branch_resolving tex_throttle membar sleeping; do
      printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$s"; done)
  METRICS="${STALLS}l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum"
  for v in today ring smem; do
    case $v in today) E="";; ring) E="MEGAMOE_WGMMA_X_RING=4";; smem) E="MEGAMOE_MMA_X_SMEM=32";; esac
    NP="--no-peer"; [ $v = today ] && NP=""
    env $E MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers} timeout 150 ncu --kernel-name regex:'nvfp4_wgmma|nvfp4_mma_decode|matmul_ogs' \
      --launch-count 12 --metrics "$METRICS" --csv --page raw \
      python benchmarks/probe_prefill_ncu.py --tokens 4096 --calls 1 $NP > "$OUT/ncu_$v.csv" 2> "$OUT/ncu_$v.err"
    echo "$v: $(grep -c . "$OUT/ncu_$v.csv") lines"; tail -2 "$OUT/ncu_$v.err"
  done
fi
if [ "$part" = b ]; then
  STALLS=$(for s in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait \
      not_selected selected dispatch_stall no_instruction imc_miss branch_resolving tex_throttle membar sleeping; do
      printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$s"; done)
  METRICS="${STALLS}sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum"
  for v in ws ws0 v1; do
    case $v in ws) E="";; ws0) E="MEGAMOE_ATTN_WS=0";; v1) E="MEGAMOE_ATTN_IMPL=v1";; esac
    env $E timeout 150 ncu --kernel-name regex:'sparse_mqa|_combine_kernel' --metrics "$METRICS" --csv --page raw \
      python benchmarks/probe_attention_ncu.py --cases csa:128:32768,csa:32:32768 --calls 1 > "$OUT/attn_ncu_$v.csv" 2> "$OUT/attn_ncu_$v.err"
    echo "$v: $(grep -c . "$OUT/attn_ncu_$v.csv") lines"; tail -2 "$OUT/attn_ncu_$v.err"
  done
fi
if [ "$part" = c ]; then
  MEGAMOE_ATTN_S_REPLICATED=1 timeout 420 python benchmarks/validate_attention_ws.py --batches 32,128 --contexts 32768 \
    --out "$OUT/attn_srep" > "$OUT/attn_srep.log" 2>&1
  grep -E "^FAIL|correctness" "$OUT/attn_srep.log"; tail -6 "$OUT/attn_srep.log"
  timeout 200 python benchmarks/validate_attention_ws.py --batches 32,128 --contexts 32768 --no-check \
    --out "$OUT/attn_today" > "$OUT/attn_today.log" 2>&1
  tail -6 "$OUT/attn_today.log"
fi
if [ "$part" = d ]; then
  timeout 130 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_fused_decode.py \
    "tests/layers/test_moe_layer.py::test_cuda_fused_decode_graph_sync_free" > "$OUT/megamoe_tests.log" 2>&1
  echo "megamoe tests rc=$?"; tail -4 "$OUT/megamoe_tests.log"
  timeout 60 python benchmarks/bench_moe_fused_decode.py --configs v4-flash --tokens 1,2,4,8,16 --iters 30 \
    --out-dir "$OUT" --tag moe_fused_decode_v1 > "$OUT/megamoe_bench.log" 2>&1
  echo "megamoe bench rc=$?"; grep "^| " "$OUT/megamoe_bench.log" | tail -8
  timeout 100 python -m pytest -q -p no:cacheprovider -m cuda tests/layers/test_attention_layer.py \
    tests/layers/test_fused_projections.py "tests/models/test_v4_model.py::test_decode_graph_replay_equals_eager_and_is_sync_free" \
    > "$OUT/fused_proj_tests.log" 2>&1
  echo "fused-proj cuda tests rc=$?"; tail -3 "$OUT/fused_proj_tests.log"
  timeout 40 python -m pytest -q -p no:cacheprovider tests/layers/test_fused_projections.py -k strided \
    > "$OUT/fused_proj_strided.log" 2>&1
  echo "strided rc=$?"; tail -2 "$OUT/fused_proj_strided.log"
  timeout 40 python -m pytest -q -p no:cacheprovider --tb=long "tests/kernels/test_hyper_connection_kernels.py::test_hc_post_pre_equals_unfused" \
    > "$OUT/hc_post_pre_gpu.log" 2>&1
  echo "hc post_pre rc=$?"; grep -E "^E |passed|failed" "$OUT/hc_post_pre_gpu.log" | head -12
  timeout 80 python benchmarks/profile_decode_step.py --layers 4 --batch 1 --replays 5 --out "$OUT" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep "^## " "$OUT/profile.log"
fi
