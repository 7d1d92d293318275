#!/bin/bash
# GPU checks of 2026-11-27 (session part 20), on a 2-GPU machine (nvidia-h100-x2) while one is lent. Calls:
#   a -> the expert-parallel decode step on 2 GPUs: where a capacity-mode (CUDA-graph) EP forward spends its time
#        (kernels of one replay: NCCL, GEMMs, glue) and what the exchange primitives cost alone (NCCL all-to-all /
#        all-gather, NVLink peer-to-peer through symmetric memory); bench_ep.py with its batched timing (part 9's
#        numbers counted host skew; never rerun); the EP CUDA tests on 2 GPUs.
#   b -> a: at 1 token per rank the step spent 145 us in 84 small glue kernels (the send-slot and receive-order
#        arithmetic in torch ops). New: the pack and receive-order kernels (megamoe/kernels/ep_exchange.py), one
#        launch each. Their tests on the GPU, the EP CUDA tests, the probe and bench_ep again, and the EP generate
#        (8 layers, batch 1 / 8) against one GPU.
#   c -> b: 1 token per rank 158 us (H100), glue 11 kernels / 30 us; NCCL's three calls ~10-12 us each. New: the
#        GEMMs sized by max_rows_per_expert (W * capacity tokens), the fused route + dispatch, and peer-to-peer
#        stores into a symmetric-memory workspace instead of NCCL in capacity mode (exchange="auto" -> "p2p").
#        Tests on the GPU (incl. p2p == nccl bit for bit, graph steps == eager); the probe for the code before
#        this session (_base/, commit c5052b1, not committed) and for nccl / p2p now, all on this machine;
#        bench_ep; the EP generate against one GPU.
#   d -> c (same H200 x2 machine kind): 1 token per rank 284.9 (before this session) -> 138.4 (nccl) -> 116.2 us
#        (p2p). New: the return stores gather through back_index (no index_select). The EP tests on the GPU, the
#        probe (nccl / p2p), the EP generate against one GPU at batch 1 / 8 / 64.
#   e -> the whole V4-Flash (43 layers, random NVFP4 weights) expert-parallel on 2 H200s (about 78 GiB per rank:
#        it does not fit one GPU): generate --ep at batch 1 / 8 with the code of d.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results/gpu_check_v31}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
NG=$(python -c "import torch; print(torch.cuda.device_count())")
case "$1" in
a)
  nvidia-smi topo -m > "$OUT/a_topo.txt" 2>&1; cat "$OUT/a_topo.txt" | head -6
  timeout 240 torchrun --nproc-per-node "$NG" benchmarks/probe_ep_exchange.py --tokens 1,8,64 \
    --out "$OUT/a_ep_probe.md" > "$OUT/a_ep_probe.log" 2>&1; tail -30 "$OUT/a_ep_probe.log"
  timeout 200 torchrun --nproc-per-node "$NG" benchmarks/bench_ep.py --tokens 1,8,64,256 --graph-max 256 \
    --out "$OUT/a_ep_bench.json" > "$OUT/a_ep_bench.log" 2>&1; tail -8 "$OUT/a_ep_bench.log"
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda tests/distributed/test_ep_moe_cuda.py \
    > "$OUT/a_tests.log" 2>&1; tail -3 "$OUT/a_tests.log"
  ;;
b)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kernels/test_ep_exchange.py \
    tests/distributed/test_ep_moe_cuda.py tests/distributed/test_ep_generate.py::test_cuda_generate_ep_world_one_nccl \
    > "$OUT/b_tests.log" 2>&1; tail -3 "$OUT/b_tests.log"
  timeout 200 torchrun --nproc-per-node "$NG" benchmarks/probe_ep_exchange.py --tokens 1,8,64 \
    --out "$OUT/b_ep_probe.md" > "$OUT/b_ep_probe.log" 2>&1; grep -E "^## |graph replay|^  - " "$OUT/b_ep_probe.md"
  timeout 150 torchrun --nproc-per-node "$NG" benchmarks/bench_ep.py --tokens 1,8,64,256 --graph-max 256 \
    --out "$OUT/b_ep_bench.json" > "$OUT/b_ep_bench.log" 2>&1; grep tokens_per_rank "$OUT/b_ep_bench.log" | cut -c1-400
  ( timeout 150 torchrun --nproc-per-node "$NG" -m megamoe generate --ep --layers 8 --batch 1,8 --steps 16
    timeout 100 python -m megamoe generate --layers 8 --batch 1,8 --steps 16 ) > "$OUT/b_generate.log" 2>&1
  grep -iE "ms|token" "$OUT/b_generate.log" | tail -12
  ;;
c)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kernels/test_ep_exchange.py \
    tests/distributed/test_ep_moe_cuda.py > "$OUT/c_tests.log" 2>&1; tail -3 "$OUT/c_tests.log"
  ( cd _base && timeout 150 torchrun --nproc-per-node "$NG" benchmarks/probe_ep_exchange.py --tokens 1,8,64 \
    --exchange legacy --out "$OUT/c_probe_base.md" ) > "$OUT/c_probe.log" 2>&1
  timeout 200 torchrun --nproc-per-node "$NG" benchmarks/probe_ep_exchange.py --tokens 1,8,64 --exchange nccl,p2p \
    --out "$OUT/c_probe.md" >> "$OUT/c_probe.log" 2>&1
  grep -hE "^## |graph replay|^  - " "$OUT/c_probe_base.md" "$OUT/c_probe.md"
  timeout 150 torchrun --nproc-per-node "$NG" benchmarks/bench_ep.py --tokens 1,8,64,256 --graph-max 256 \
    --out "$OUT/c_ep_bench.json" > "$OUT/c_ep_bench.log" 2>&1; grep tokens_per_rank "$OUT/c_ep_bench.log" | cut -c1-300
  ( timeout 150 torchrun --nproc-per-node "$NG" -m megamoe generate --ep --layers 8 --batch 1,8 --steps 16
    timeout 100 python -m megamoe generate --layers 8 --batch 1,8 --steps 16 ) > "$OUT/c_generate.log" 2>&1
  grep -E "ms/token|same tokens|^model" "$OUT/c_generate.log"
  ;;
d)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kernels/test_ep_exchange.py \
    tests/distributed/test_ep_moe_cuda.py tests/distributed/test_ep_generate.py::test_cuda_generate_ep_world_one_nccl \
    > "$OUT/d_tests.log" 2>&1; tail -3 "$OUT/d_tests.log"
  timeout 150 torchrun --nproc-per-node "$NG" benchmarks/probe_ep_exchange.py --tokens 1,8,64 --exchange nccl,p2p \
    --out "$OUT/d_probe.md" > "$OUT/d_probe.log" 2>&1; grep -hE "^## |graph replay|^  - " "$OUT/d_probe.md"
  ( timeout 150 torchrun --nproc-per-node "$NG" -m megamoe generate --ep --layers 8 --batch 1,8,64 --steps 16
    timeout 100 python -m megamoe generate --layers 8 --batch 1,8,64 --steps 16 ) > "$OUT/d_generate.log" 2>&1
  grep -E "ms/token|same tokens|^model" "$OUT/d_generate.log"
  ;;
e)
  timeout 230 torchrun --nproc-per-node "$NG" -m megamoe generate --ep --layers 43 --batch 1,8 --steps 16 \
    > "$OUT/e_generate_full.log" 2>&1; grep -vE "^W1127|\*\*\*\*|OMP_NUM" "$OUT/e_generate_full.log" | tail -14
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader
  ;;
*)
  echo "unknown call $1"; exit 2;;
esac
