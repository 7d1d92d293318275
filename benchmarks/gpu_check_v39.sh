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
#   d -> c: PDL on every kernel: step 935.7 -> 975.4 us at batch 1, 2052 -> 2093 at 8, 5649 -> 5411 at 64 (one run each);
#        the model tests pass with it. The profile shows the bf16 head reading 1.06 GB in 240 us (4.4 TB/s) on this
#        GPU, while our decode GEMMs read ~2.4-3.1 TB/s here. This GPU's read ceiling on long streams (2 GiB: a Triton
#        contiguous read, torch.sum), and the decode band's weights through a cp.async ring (more bytes in flight
#        per program: mma.MMA_DECODE_CONFIGS[4] with 3 / 4 stages) at 16 / 64 / 128 tokens, both models.
#   e -> d: this H200 reads 4.48-4.63 TB/s on 2 GiB streams (our decode GEMMs read 2.9-3.2 TB/s of it here); the
#        cp.async weight ring in the decode band is 0.78-0.91x of the register path. EP regression check on 2 GPUs
#        (a multi-GPU kind is lent; EP last ran on GPUs in part 20, gpu_check_v31, before the shared-expert overlap,
#        the overlapped bands and the early-reading down GEMM): the EP CUDA tests, and generate --ep at batch 1 / 8 / 64
#        on 8 layers against one GPU.
#   f -> e (2 H200s): EP CUDA tests 110 passed, 3 skipped; generate --ep (8 layers) 2.33 / 3.20 / 7.33 ms per token at
#        batch 1 / 8 / 64 against 1.76 / 3.43 / 10.07 on one GPU. Back on one H200: the decode band with BLOCK_K 512
#        (two programs per SM, 32 KB of weights in flight each: 64 KB per SM against the default's 3 x 16 KB), the
#        bytes-in-flight lever that the ring (d) could not pull, at 16 / 64 tokens, both models.
#   g -> f: BLOCK_K 512 is 0.84-0.92x: the decode band is not bound by its weight bytes in flight here. Back to the
#        all-on-k band: 64-column tiles of one m64 wgmma, 3 stages, 3 programs per SM under a 168-register cap
#        (offline sm_90 on the interleaved layout: 168 registers, 8 B of stack outside the K loop, 329 SASS per step):
#        six hot V4-Flash experts become 384 tiles on 396 slots (every SM 2-3 tiles of 64 columns instead of 1-2 of
#        128), with no split items; 48 / 64 tokens, three routings, V4-Flash (V4-Pro's shapes take the wide band).
# Calls a and b ran the experiment's tree (commit 034fd65: gemm.PIPE_ABOVE_SPLIT, probe_band64.py --splits), reverted
# in dcf8025: check that commit out to repeat them.
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
d)
  timeout 90 python - <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
from graph_timing import use_flush_mode, graph_replay_us
use_flush_mode("read")
from probe_stream import _contiguous_kernel
x = torch.ones(1 << 29, dtype=torch.float32, device="cuda")  # 2 GiB
t = graph_replay_us(lambda: x.sum(), warmup=3, rep=20)
print(f"torch.sum over 2 GiB float32: {t:.1f} us, {x.numel() * 4 / t / 1e6:.2f} TB/s read")
w = x.view(torch.int32)
for chunk, progs in ((8192, 4096), (16384, 2048), (16384, 8192)):
    steps = w.numel() * 4 // (chunk * progs)
    out = torch.empty(progs, dtype=torch.int32, device="cuda")
    t = graph_replay_us(lambda: _contiguous_kernel[(progs,)](w, out, CHUNK=chunk, STEPS=steps), warmup=3, rep=20)
    print(f"contiguous read {chunk} B per step, {progs} programs: {t:.1f} us, {progs * chunk * steps / t / 1e6:.2f} TB/s")
PY
  S="base|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,4,3)|mma.MMA_DECODE_CONFIGS[4]=(8,128,256,4,4)"
  timeout 380 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 16,64,128 --flush read \
    --rounds 2 --routings router,zipf --settings "$S" --out "$OUT" --tag d_decode_ring 2>&1 | tail -40
  ;;
e)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  NG=$(python -c "import torch; print(torch.cuda.device_count())"); echo "gpus $NG"
  timeout 260 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kernels/test_ep_exchange.py \
    tests/distributed/test_ep_moe_cuda.py tests/distributed/test_ep_generate.py > "$OUT/e_tests.log" 2>&1
  tail -1 "$OUT/e_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/e_tests.log" | head -8
  ( timeout 170 torchrun --nproc-per-node "$NG" -m megamoe generate --ep --layers 8 --batch 1,8,64 --steps 16
    timeout 120 python -m megamoe generate --layers 8 --batch 1,8,64 --steps 16 ) > "$OUT/e_generate.log" 2>&1
  grep -E "decode|model|Error|error" "$OUT/e_generate.log" | tail -14
  ;;
f)
  S="base|mma.MMA_DECODE_CONFIGS[4]=(8,128,512,4)"
  timeout 300 python benchmarks/ab_layer_settings.py --configs v4-flash,v4-pro --tokens 16,64 --flush read \
    --rounds 2 --routings router,zipf --settings "$S" --out "$OUT" --tag f_decode_bk512 2>&1 | tail -16
  ;;
g)
  S="base|pipe.PIPE_BAND64_NARROW_CONFIG=(64,64,128,4,3,3,168)"
  timeout 200 python benchmarks/ab_layer_settings.py --configs v4-flash --tokens 48,64 --flush read \
    --rounds 2 --routings all-on-k,zipf,router --settings "$S" --out "$OUT" --tag g_band64_bn64 2>&1 | tail -12
  timeout 60 python benchmarks/probe_band64.py --configs v4-flash --out "$OUT/g_band64_base.md" 2>&1 | tail -2
  timeout 60 python benchmarks/probe_band64.py --configs v4-flash --narrow 64,64,128,4,3,3,168 \
    --out "$OUT/g_band64_bn64.md" 2>&1 | tail -2
  ;;
esac
