# GPU check v24 (2026-11-26, part 13): the small-row band at ~512 tokens, where the peer leads most (issue 10).
#   a -> kernel-alone sweep of small-band tile configs (sweep_pipe_small.py, V4-Flash 12 / V4-Pro 8 rows per expert),
#        the layer's kernels at 512 tokens (probe_moe_decode.py), ncu of ours vs the peer at 512 tokens (V4-Flash).
#   b -> the band plans at 512 tokens of uniform routing (the 17-32-row band as its own launch or merged; 16-row tiles
#        with 8 ring stages, or three programs per SM), and the 16-row configs on equal rows per expert.
#   c -> b again with the routed plans fixed (b's routed sweep failed on an argument bug), plus wait depth 2 / 3 and
#        8-row tiles (wgmma N = 8) on the 16-row configs.
#   d -> with the 16-row band at 8 ring stages (the default now): the CUDA tests of the pipelined kernel and the bands,
#        the MoE layer A/B of 6 vs 8 stages (V4-Flash / V4-Pro, 512 / 1024 tokens, the layer's own router).
#   e -> the routed experts against the peer and the bf16 layer (V4-Flash) at 512 / 1024 tokens, uniform and Zipf.
#   f -> ncu of ours vs the peer at V4-Pro 512 tokens (the peer streams it at ~97% of our floor, we at ~63%).
#   g -> f showed the peer at 16 warps per SM there (2 CTAs x 8 warps, 77% of DRAM; ours 8 warps, 54%): the 16-row band
#        with 4 programs x 4 warps or 2 x 8 warps per SM under a 128-register cap, kernel alone.
#   h -> the weights (and scales) with 4 rows interleaved per K step (256-byte runs, as the peer's Hopper layout), read
#        by the pipelined kernel with weight_interleave=4: the 16-row band and the 128-row tile, kernel alone.
#   i -> the CUDA tests of the pipelined kernel (the interleaved layout's included); the 16-row band with and without
#        the interleaved layout against the op's banded route as the layer runs it, at decode shapes (7 / 50 experts x 1
#        row) and 512 tokens.
#   j -> the mma.sync decode kernel with the interleaved layout: its CUDA tests, and at decode shapes (7 / 50 experts x
#        1 row, 6 x 64 rows) against the op's route, kernel alone.
#   k -> NVFP4Tensor.row_interleave through the grouped op and Nvfp4MoE(row_interleave=4): the CUDA tests, then the
#        routed experts row-major vs interleaved against the peer (V4-Flash, 1-4096 tokens, uniform).
#   l -> the same for V4-Pro.
#   m -> k / l at 512-8192 tokens under uniform, Zipf and all-on-k routing, 60 ms of replays per point.
#   n -> interleave groups of 2 / 4 / 8 rows in the mma.sync decode kernel and the 16-row band (kernel alone): is there
#        a group that keeps decode as fast as row-major and prefill as fast as 4? (Run with the launchers' check
#        temporarily widened to 1 / 2 / 4 / 8; they accept 1 / 4 again, as NVFP4Tensor does.)
#   o -> decode configs of the mma.sync kernel (BLOCK_K 128 / 256, BLOCK_N 64 / 128, the weight ring) row-major vs
#        interleaved: does some config read the interleaved layout at decode as fast as today's reads row-major?
#   p -> with the decode band of a gathered GEMM on interleaved weights at BLOCK_N 64 (INTERLEAVED_DECODE_BLOCK_N): the
#        CUDA tests, then the routed experts row-major vs interleaved vs the peer at 1 / 8 / 64 tokens (uniform, Zipf).
#   q -> the op and layer tests of the interleaved layout on the GPU (not marked cuda: k and p ran "-m cuda" and so
#        deselected them).
#   r -> the whole op / layer / format / quantize test files touched by the layout on the GPU (cuda-marked or not).
#   s -> the MoE layer's kernels at 64 tokens, row-major vs interleaved (where do the 1.4-2.3% go?).
#   t -> decode-band configs for the gathered gate_up on interleaved weights at 16 / 64 tokens of uniform routing.
#   u -> after the review refactor (one offsets helper, the band plan owning the interleaved rules): every test of the
#        interleaved layout on the GPU, cuda-marked or not.
# Run with carry [".peers"] (the peer). At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v24}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 260 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag a --configs \
    "pipe:16,128,128,4,6,2;pipe:16,128,128,4,8,2;pipe:16,128,128,4,4,2;pipe:16,256,128,8,6,1;pipe:32,256,128,8,4,1;mma:16,128,128,4,4" \
    2>&1 | grep -v "^{" | tail -5
  timeout 120 python benchmarks/probe_moe_decode.py --tokens 512 --configs v4-flash,v4-pro --out "$OUT" 2>&1 | tail -3
  timeout 180 ncu --kernel-name regex:'nvfp4_wgmma|nvfp4_mma_decode|matmul_ogs' --launch-count 20 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
    python benchmarks/probe_prefill_ncu.py --tokens 512 --calls 1 > "$OUT/ncu_512.csv" 2> "$OUT/ncu_512.err"
  tail -3 "$OUT/ncu_512.err"; wc -l "$OUT/ncu_512.csv" ;;
b)
  B64="inf=64,256,128,8,4"
  timeout 300 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag b_routed --shapes v4-flash:t512,v4-pro:t512 --configs \
    "bands:16=16,128,128,4,6,2|32=32,128,128,4,6,2|$B64;bands:16=16,128,128,4,8,2|32=32,128,128,4,6,2|$B64;bands:32=32,128,128,4,6,2|$B64;bands:16=16,128,128,4,5,3,168|32=32,128,128,4,6,2|$B64;bands:16=16,128,128,4,8,2|$B64" \
    2>&1 | grep -v "^{" | tail -3
  timeout 200 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag b_equal --configs \
    "pipe:16,128,128,4,8,2;pipe:16,128,128,4,5,3,168;pipe:16,128,128,4,4,3,168;pipe:32,128,128,4,6,2" 2>&1 | grep -v "^{" | tail -3 ;;
c)
  B32="32=32,128,128,4,6,2|inf=64,256,128,8,4"
  timeout 300 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag c_routed --shapes v4-flash:t512,v4-pro:t512 --configs \
    "bands:16=16,128,128,4,6,2|$B32;bands:16=16,128,128,4,8,2|$B32;bands:16=16,128,128,4,8,2|$B32@w2;bands:16=16,128,128,4,8,2|$B32@w3;bands:8=8,128,128,4,8,2|16=16,128,128,4,8,2|$B32;bands:32=32,128,128,4,6,2|inf=64,256,128,8,4" \
    2>&1 | grep -v "^{" | tail -3
  timeout 200 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag c_equal --shapes v4-flash:12,v4-pro:8,v4-pro:5 --configs \
    "pipe:16,128,128,4,8,2;pipe:16,128,128,4,8,2@w2;pipe:16,128,128,4,8,2@w3;pipe:8,128,128,4,8,2;pipe:8,128,128,4,8,2@w3" 2>&1 | grep -v "^{" | tail -3 ;;
d)
  timeout 200 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    tests/ops/test_gemm_bands.py > "$OUT/d_tests.log" 2>&1
  tail -3 "$OUT/d_tests.log"
  timeout 330 python benchmarks/ab_moe_band_config.py --band 16 --a 16,128,128,4,6,2 --b 16,128,128,4,8,2 \
    --tokens 512,1024 --out "$OUT" --tag d 2>&1 | tail -6 ;;
e)
  timeout 300 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,1024 --routings uniform,zipf \
    --rep-ms 20 --budget-s 260 --out-dir "$OUT" --tag e_peer_flash 2>&1 | grep -v "^  " | tail -6
  timeout 250 python benchmarks/bench_peer.py --configs v4-pro --tokens 512,1024 --routings uniform,zipf --no-bf16 \
    --rep-ms 20 --budget-s 200 --out-dir "$OUT" --tag e_peer_pro 2>&1 | grep -v "^  " | tail -6 ;;
f)
  timeout 400 ncu --kernel-name regex:'nvfp4_wgmma|matmul_ogs' --launch-count 20 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum \
    --csv --page details python benchmarks/probe_prefill_ncu.py --config v4-pro --tokens 512 --calls 1 \
    > "$OUT/f_ncu_pro_512.csv" 2> "$OUT/f_ncu_pro_512.err"
  tail -3 "$OUT/f_ncu_pro_512.err"; wc -l "$OUT/f_ncu_pro_512.csv" ;;
g)
  timeout 300 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag g_occupancy --shapes v4-flash:12,v4-pro:8 --configs \
    "pipe:16,128,128,4,8,2;pipe:16,128,128,4,4,4,128;pipe:16,256,128,8,4,2,128;pipe:16,256,128,8,4,1" 2>&1 | grep -v "^{" | tail -3 ;;
h)
  timeout 400 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag h_interleave --shapes v4-flash:12,v4-pro:8,v4-flash:96 --configs \
    "pipe:16,128,128,4,8,2;pipe:16,128,128,4,8,2@i4;pipe:128,256,128,8,4;pipe:128,256,128,8,4@i4" 2>&1 | grep -v "^{" | tail -3 ;;
i)
  timeout 200 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_wgmma_pipe.py \
    > "$OUT/i_tests.log" 2>&1
  tail -3 "$OUT/i_tests.log"
  timeout 300 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag i_decode \
    --shapes v4-flash:e7x1,v4-flash:e50x1,v4-pro:e7x1,v4-flash:t512,v4-pro:t512 --configs \
    "op:;pipe:16,128,128,4,8,2;pipe:16,128,128,4,8,2@i4" 2>&1 | grep -v "^{" | tail -3 ;;
j)
  timeout 200 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    -k "interleave" tests/kernels/gemm/test_nvfp4_wgmma_pipe.py > "$OUT/j_tests.log" 2>&1
  tail -3 "$OUT/j_tests.log"
  timeout 300 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag j_decode \
    --shapes v4-flash:e7x1,v4-flash:e50x1,v4-pro:e7x1,v4-pro:e50x1,v4-flash:e6x64 --configs \
    "op:;mma:8,128,256,4;mma:8,128,256,4@i4;mma:32,128,128,4;mma:32,128,128,4@i4" 2>&1 | grep -v "^{" | tail -3 ;;
k)
  timeout 250 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    tests/format tests/ops/test_gemm.py tests/layers/test_moe_layer.py tests/ops/test_gemm_bands.py > "$OUT/k_tests.log" 2>&1
  tail -3 "$OUT/k_tests.log"
  timeout 330 python benchmarks/bench_peer.py --configs v4-flash --tokens 1,8,64,512,2048,4096 --routings uniform \
    --both-interleave --no-bf16 --rep-ms 20 --budget-s 300 --out-dir "$OUT" --tag k_peer_il_flash 2>&1 | grep -v "^  " | tail -9 ;;
l)
  timeout 560 python benchmarks/bench_peer.py --configs v4-pro --tokens 1,8,64,512,2048,4096 --routings uniform \
    --both-interleave --no-bf16 --rep-ms 20 --budget-s 480 --out-dir "$OUT" --tag l_peer_il_pro 2>&1 | grep -v "^  " | tail -9 ;;
m)
  timeout 290 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,2048,8192 --routings uniform,zipf,all-on-k \
    --both-interleave --no-bf16 --rep-ms 60 --budget-s 260 --out-dir "$OUT" --tag m_peer_il_flash 2>&1 | grep -v "^  " | tail -4
  timeout 290 python benchmarks/bench_peer.py --configs v4-pro --tokens 512,2048,8192 --routings uniform,zipf,all-on-k \
    --both-interleave --no-bf16 --rep-ms 60 --budget-s 260 --out-dir "$OUT" --tag m_peer_il_pro 2>&1 | grep -v "^  " | tail -4 ;;
n)
  timeout 500 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag n_groups \
    --shapes v4-pro:e7x1,v4-flash:e50x1,v4-pro:e50x1,v4-pro:t512,v4-flash:t512 --configs \
    "mma:8,128,256,4;mma:8,128,256,4@i2;mma:8,128,256,4@i4;mma:8,128,256,4@i8;pipe:16,128,128,4,8,2;pipe:16,128,128,4,8,2@i2;pipe:16,128,128,4,8,2@i4;pipe:16,128,128,4,8,2@i8" \
    2>&1 | grep -v "^{" | tail -3 ;;
o)
  timeout 400 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag o_decode_configs \
    --shapes v4-pro:e7x1,v4-flash:e50x1,v4-pro:e50x1 --configs \
    "mma:8,128,256,4;mma:8,128,256,4@i4;mma:8,128,128,4;mma:8,128,128,4@i4;mma:8,64,256,4;mma:8,64,256,4@i4;mma:8,128,256,4,3;mma:8,128,256,4,3@i4" \
    2>&1 | grep -v "^{" | tail -3 ;;
p)
  timeout 200 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/ops/test_gemm.py tests/layers/test_moe_layer.py \
    -k "interleave" > "$OUT/p_tests.log" 2>&1
  tail -3 "$OUT/p_tests.log"
  timeout 170 python benchmarks/bench_peer.py --configs v4-flash --tokens 1,8,64 --routings uniform,zipf \
    --both-interleave --no-bf16 --rep-ms 60 --budget-s 150 --out-dir "$OUT" --tag p_peer_il_flash_decode 2>&1 | grep -v "^  " | tail -7
  timeout 200 python benchmarks/bench_peer.py --configs v4-pro --tokens 1,8,64 --routings uniform,zipf \
    --both-interleave --no-bf16 --rep-ms 60 --budget-s 170 --out-dir "$OUT" --tag p_peer_il_pro_decode 2>&1 | grep -v "^  " | tail -7 ;;
q)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/ops/test_gemm.py tests/layers/test_moe_layer.py \
    tests/format -k "interleave" > "$OUT/q_tests.log" 2>&1
  tail -3 "$OUT/q_tests.log" ;;
r)
  timeout 560 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/ops/test_gemm.py tests/layers/test_moe_layer.py \
    tests/format tests/ops/test_quantize.py tests/ops/test_moe_ops.py > "$OUT/r_tests.log" 2>&1
  tail -3 "$OUT/r_tests.log" ;;
s)
  for il in 1 4; do
    timeout 200 python benchmarks/probe_moe_decode.py --tokens 64 --configs v4-flash,v4-pro --row-interleave $il \
      --out "$OUT" --tag s_il$il 2>&1 | grep -E "^## |_nvfp4" | head -12
  done ;;
t)
  timeout 400 python benchmarks/sweep_pipe_small.py --out "$OUT" --tag t_decode64 \
    --shapes v4-flash:t64,v4-pro:t64,v4-flash:t16 --configs \
    "op:;mma:8,128,256,4;mma:8,64,256,4@i4;mma:8,64,128,4@i4;mma:8,64,256,4,3@i4;mma:8,128,256,4@i4" \
    2>&1 | grep -v "^{" | tail -3 ;;
u)
  timeout 400 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/ops/test_gemm.py tests/layers/test_moe_layer.py \
    tests/ops/test_gemm_bands.py tests/format tests/kernels/gemm/test_nvfp4_mma_interleave.py \
    tests/kernels/gemm/test_nvfp4_wgmma_pipe.py -k "interleave" > "$OUT/u_tests.log" 2>&1
  tail -3 "$OUT/u_tests.log" ;;
esac
