#!/usr/bin/env bash
# gpu_check_v15's three parts, packed for a 2-GPU machine (nvidia-h100-x2): two calls of < 10 min each.
#   a: GPU 0 runs v15 "tests" (PDL, x ring, x smem, MoE layer, EP world 1); GPU 1 runs v15 "gemm" without the
#      dense sweep (x-operand staging vs today, the peer beside both). Needs carry=[".peers"].
#   b: expert parallel on both GPUs (NCCL world 2: tests, bench_ep, generate --ep, run --ep), then v15 "moe"
#      split over the two GPUs (today | shared overlap, each with and without PDL) and the dense split-K sweep.
# Each GPU runs one program at a time, so the timings of one GPU are not disturbed by the other's kernels
# (separate HBM and SMs; the host has 32 cores). Results are tarred into $OUT/<part>.tgz with the logs.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/megamoe-gpu-check-v16}
mkdir -p "$OUT"
part=${1:-a}
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" \
  | tee -a "$OUT/device.txt"
if [ "$part" = a ]; then
  mkdir -p "$OUT/tests" "$OUT/gemm"
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 400 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/kernels/test_pdl.py \
      tests/kernels/gemm/test_nvfp4_wgmma_x_ring.py tests/kernels/gemm/test_nvfp4_mma_x_smem.py \
      tests/kernels/gemm/test_nvfp4_gluon.py::test_cuda_wgmma_sync_free_and_graph tests/layers/test_moe_layer.py \
      tests/distributed/test_ep_generate.py tests/distributed/test_ep_moe_cuda.py 2>&1 | grep -v "^\s*$" | tail -25
    timeout 130 python benchmarks/bench_pdl.py --tokens 1,8 --out "$OUT/tests/pdl_v2" 2>&1 | grep -v Warn | tail -14
  ) > "$OUT/gpu0_tests.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 250 python benchmarks/bench_x_operand.py --out-dir "$OUT/gemm" 2>&1 | grep -v Warn | tail -34
    timeout 140 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,4096 --routings uniform --no-bf16 \
      --out-dir "$OUT/gemm" --tag peer_today 2>&1 | grep -v Warn | tail -6
    MEGAMOE_WGMMA_X_RING=4 MEGAMOE_MMA_X_SMEM=32 timeout 140 python benchmarks/bench_peer.py --configs v4-flash \
      --tokens 512,4096 --routings uniform --no-bf16 --out-dir "$OUT/gemm" --tag peer_x_operand 2>&1 | grep -v Warn | tail -6
  ) > "$OUT/gpu1_gemm.log" 2>&1 &
  wait
  tar czf "$OUT/a.tgz" -C "$OUT" tests gemm
elif [ "$part" = b ]; then
  mkdir -p "$OUT/ep" "$OUT/moe"
  {
    timeout 200 python -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/distributed/test_ep_moe_cuda.py \
      2>&1 | grep -v "^\s*$" | tail -8
    timeout 150 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 1,8,64,256,1024,4096 \
      --out "$OUT/ep/ep_v1_x2.json" 2>&1 | grep -v Warn | tail -16
    timeout 120 torchrun --nproc-per-node 2 -m megamoe generate --ep --layers 8 --batch 1,8 --steps 16 2>&1 \
      | grep -v Warn | tail -16
    timeout 90 python -m megamoe generate --layers 8 --batch 1,8 --steps 16 2>&1 | grep -v Warn | tail -16
    timeout 60 torchrun --nproc-per-node 2 -m megamoe run --ep 2>&1 | grep -v Warn | tail -8
  } > "$OUT/ep.log" 2>&1
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 90 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 --out-dir "$OUT/moe" --tag moe_base \
      2>&1 | grep "^| deepseek"
    MEGAMOE_PDL=1 timeout 90 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 --out-dir "$OUT/moe" \
      --tag moe_base_pdl 2>&1 | grep "^| deepseek"
    timeout 90 python benchmarks/bench_moe.py --configs v4-pro --tokens 1,8 --out-dir "$OUT/moe" --tag moe_pro 2>&1 \
      | grep "^| deepseek"
  ) > "$OUT/gpu0_moe.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 90 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 --shared-overlap --out-dir "$OUT/moe" \
      --tag moe_overlap 2>&1 | grep "^| deepseek"
    MEGAMOE_PDL=1 timeout 90 python benchmarks/bench_moe.py --configs v4-flash --tokens 1,8,16 --shared-overlap \
      --out-dir "$OUT/moe" --tag moe_overlap_pdl 2>&1 | grep "^| deepseek"
    timeout 90 python benchmarks/bench_gemm.py --dense-splitk --rep-ms 20 --tag gemm_dense_v16 --out-dir "$OUT/moe" 2>&1 \
      | grep -v Warn | tail -4
  ) > "$OUT/gpu1_moe.log" 2>&1 &
  wait
  tar czf "$OUT/b.tgz" -C "$OUT" ep moe
elif [ "$part" = c ]; then
  # follow-up of a and b: which family breaks the PDL decode graph (GPU 0) beside V4-Pro (GPU 1), then the EP
  # programs again with whole logs (b's were cut by tail) and Python stacks on a hang (faulthandler, SIGABRT)
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/c"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python benchmarks/pdl_bisect.py --repeats 2 > "$OUT/pdl_bisect.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 200 python benchmarks/bench_moe.py --configs v4-pro --tokens 1,8 --out-dir "$OUT/c" \
    --tag moe_pro > "$OUT/moe_pro.log" 2>&1 &
  wait
  timeout 150 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 1,8,64,256,1024,4096 \
    --out "$OUT/c/ep_v1_x2.json" > "$OUT/ep_bench.log" 2>&1
  timeout 90 torchrun --nproc-per-node 2 -m megamoe run --ep > "$OUT/ep_run.log" 2>&1
  ( sleep 160; pkill -ABRT -f "megamoe generate" ) > /dev/null 2>&1 &
  watchdog=$!
  timeout 180 torchrun --nproc-per-node 2 -m megamoe generate --ep --layers 8 --batch 1,8 --steps 16 \
    > "$OUT/ep_generate.log" 2>&1
  kill "$watchdog" 2> /dev/null; pkill -f "sleep 160" 2> /dev/null
  for f in pdl_bisect moe_pro ep_bench ep_run ep_generate; do
    echo "=== $f"; grep -v "Warn\|^\s*$" "$OUT/$f.log" | grep -i -m 12 "error\|exception\|Traceback" ; tail -30 "$OUT/$f.log"
  done
  tar czf "$OUT/c.tgz" -C "$OUT" c && rm -rf "$OUT/c"
  exit 0
elif [ "$part" = d ]; then
  # after c: the decode graph vs eager with teacher forcing (logit diffs per step, PDL off/on) beside the model's
  # graph test; then bench_ep (import fixed) and generate --ep (graphs released before destroy_process_group)
  export PYTHONFAULTHANDLER=1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/pdl_bisect.py --teacher > "$OUT/graph_teacher.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q -p no:cacheprovider -m cuda --tb=short \
    tests/models/test_v4_model.py -k "graph" > "$OUT/model_graph_test.log" 2>&1 &
  wait
  timeout 170 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 1,8,64,256,1024,4096 \
    --out "$OUT/ep_v1_x2.json" > "$OUT/ep_bench.log" 2>&1
  ( sleep 150; pkill -ABRT -f "megamoe generate" ) > /dev/null 2>&1 &
  watchdog=$!
  timeout 170 torchrun --nproc-per-node 2 -m megamoe generate --ep --layers 8 --batch 1,8 --steps 16 \
    > "$OUT/ep_generate.log" 2>&1
  echo "generate --ep exit code $?" >> "$OUT/ep_generate.log"
  kill "$watchdog" 2> /dev/null; pkill -f "sleep 150" 2> /dev/null
  for f in graph_teacher model_graph_test ep_bench ep_generate; do
    echo "=== $f"; grep -v "^W11\|^\s*$" "$OUT/$f.log" | tail -24
  done
  exit 0
elif [ "$part" = e ]; then
  # after d: the free-running decode graph traced against eager on the graph's own inputs; bench_ep with a
  # capacity sized to each T and the graphs released before destroy_process_group
  CUDA_VISIBLE_DEVICES=0 timeout 100 python benchmarks/pdl_bisect.py --trace --repeats 3 > "$OUT/graph_trace.log" 2>&1
  timeout 180 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 1,8,64,256,1024,4096 \
    --out "$OUT/ep_v2_x2.json" > "$OUT/ep_bench.log" 2>&1
  echo "bench_ep exit code $?" >> "$OUT/ep_bench.log"
  for f in graph_trace ep_bench; do
    echo "=== $f"; grep -v "^W11\|^\s*$" "$OUT/$f.log" | tail -14
  done
  exit 0
fi
for f in "$OUT"/*.log; do echo "=== $f"; cat "$f"; done
