#!/bin/bash
# GPU checks of 2026-11-28 (session part 28). Calls:
#   a -> issue 10's all-on-k point: the pipelined 64-row band holds six hot experts as 192 tiles (V4-Flash, 128
#        columns) on 132 SMs, so 60 SMs run a second round while 72 idle; 256-column tiles (V4-Pro) 144 / 168 tiles.
#        K splits chosen on the device from the tile count (gemm.PIPE_ABOVE_SPLIT, kernel SPLIT) fill the last round.
#        CUDA tests of the pipelined kernel (new: the K splits); the layer A/B at 32-128 tokens, three routings, both
#        models: split_max 2 and 4 against the default (no splits).
#   b -> a: the K splits made the layer SLOWER at all-on-k (V4-Flash 64 tokens 102.5 -> 129.9 us with split_max 2),
#        Zipf 0.97-1.05x, routers unchanged; the new CUDA test had a host-index bug (fixed). Why: the band alone
#        (probe_band64.py: graph replay per split_max) and ncu of it (stall reasons, per-SM active cycles min / avg /
#        max, DRAM rate) at split_max 1 / 2, V4-Flash.
#   c -> b: split K's per-item fixed costs outweigh the balance (the band alone 1.3-1.5x slower on V4-Flash), reverted.
#        Next, the decode step as a whole: PDL (MEGAMOE_PDL=1: every kernel with the prologue launched early) has only
#        been measured inside the MoE layer, never on the model step (~27 kernels per layer, latency-bound at batch 1).
#        The V4-Flash decode step (4 layers) timed (median of 40 whole steps) and profiled with PDL off / on at batch
#        1 / 8 / 64; the V4 model's CUDA tests with MEGAMOE_PDL=1 (graph == eager, sync-free).
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v39}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format="tree: %h %s" 2>/dev/null; git status --short 2>/dev/null | head -5
case "$1" in
a)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    > "$OUT/a_tests.log" 2>&1
  tail -1 "$OUT/a_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/a_tests.log" | head -5
  S="base|gemm.PIPE_ABOVE_SPLIT=2|gemm.PIPE_ABOVE_SPLIT=4"
  timeout 330 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 32,48,64,128 --flush read \
    --rounds 2 --routings all-on-k,zipf,router --settings "$S" --out "$OUT" --tag a_above_split 2>&1 | tail -40
  ;;
b)
  timeout 120 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    -k "k_splits" > "$OUT/b_tests.log" 2>&1
  tail -1 "$OUT/b_tests.log"; grep -E "^(FAILED|ERROR)|^E " "$OUT/b_tests.log" | head -8
  timeout 150 python benchmarks/probe_band64.py --configs v4-flash,v4-pro --splits 1,2,4 --out "$OUT/b_band64.md" 2>&1 \
    | tail -14
  STALLS=$(for s in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait \
      not_selected selected dispatch_stall no_instruction branch_resolving membar sleeping; do
      printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$s"; done)
  METRICS="${STALLS}sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,gpu__time_duration.sum"
  METRICS="$METRICS,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__grid_size"
  METRICS="$METRICS,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
  METRICS="$METRICS,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active"
  METRICS="$METRICS,lts__t_sectors_srcunit_tex_op_read.sum,smsp__inst_executed.sum"
  timeout 200 ncu --kernel-name regex:'nvfp4_wgmma_pipe_kernel' --launch-count 8 --metrics "$METRICS" --csv \
    --page raw python benchmarks/probe_band64.py --configs v4-flash --splits 1,2 --ncu > "$OUT/b_band64_ncu.csv" \
    2> "$OUT/b_band64_ncu.err"
  echo "ncu: $(grep -c . "$OUT/b_band64_ncu.csv") lines"; tail -2 "$OUT/b_band64_ncu.err"
  ;;
c)
  for pdl in 0 1; do
    MEGAMOE_PDL=$pdl timeout 200 python benchmarks/profile_decode_step.py --layers 4 --batch 1,8,64 --replays 5 \
      --time 40 --top 12 --tag "c_pdl$pdl" --out "$OUT" 2>&1 | grep "^## batch"
  done
  MEGAMOE_PDL=1 timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
    tests/models/test_v4_model.py > "$OUT/c_tests_pdl1.log" 2>&1
  tail -1 "$OUT/c_tests_pdl1.log"; grep -E "^(FAILED|ERROR)" "$OUT/c_tests_pdl1.log" | head -5
  ;;
esac
