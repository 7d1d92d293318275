#!/bin/bash
# GPU checks of 2026-11-28 (session part 30). Calls:
#   a -> the whole CUDA-marked suite at once (754 tests), sharded by benchmarks/run_cuda_suite.py over the GPUs of
#        the machine (4 processes per GPU, 530 s). 512 tests ran, none failed; 242 were not reached (a shard whose
#        first test, the sparse official-numerics model test, did not end in time, and shards of slow files).
#   b -> the 242 tests a did not reach (a_not_reached.txt), the two official-numerics model tests in shards of their own.
#        239 passed, none failed; the two official-numerics tests did not end in 450 s (24 processes on 64 cores, the
#        float64 reference on the CPU).
#   c -> issue 15: the sparse attention's main kernel and split combine launched with PDL by kernel name ("attention",
#        "attention_combine" in pdl.PDL_LAUNCH; before, only under the global switch). GPU 0: bench_attention.py
#        --layers 8 at batch 32 / 64, 32k / 128k, CSA / HCA, default and with the names, alternated twice (two
#        processes each); then ab_decode_step.py (one process) base vs the names, V4-Flash 4 layers, batch 1 / 32.
#        GPU 1 at the same time: the two official-numerics model tests, one process each, and the PDL CUDA tests of
#        the attention (v1 / v2 / v3, the switch and the names) and of the tiny model.
#        PDL for the attention measured no gain (per call 0.95-1.02x; decode step 0.996x / 1.000x): default stays off.
#        Official-numerics tests: 43 s / 47 s alone, passed. Attention PDL tests: 14 passed.
#   d -> a pool past 2 GiB (tests/kvcache/test_large_pool.py, new): flush, indexer scores, gather and attention (op,
#        v1, v2, v3) on the same contents at the top of a 2.2 GB FP8 pool give the bits of a small pool. Then a
#        deliberate break: the flush kernel's page index left int32 (its byte offset wraps past 2 GiB).
#        6 passed in 15 s; with the break the flush fails (illegal address), so the test errors.
#   e -> the 6 expert-parallel tests of world 2 / 4 that a skipped (each shard saw one GPU), in one shard that sees
#        every GPU (run_cuda_suite.py --all-gpus, new), on 4 GPUs.
# At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v41}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  python benchmarks/run_cuda_suite.py --procs-per-gpu "${PROCS:-4}" --timeout "${SUITE_TIMEOUT:-530}" --out "$OUT/a_suite" \
    > "$OUT/a_suite.txt" 2>&1
  tail -40 "$OUT/a_suite.txt"
  ;;
b)
  python benchmarks/run_cuda_suite.py --procs-per-gpu "${PROCS:-4}" --timeout "${SUITE_TIMEOUT:-540}" --out "$OUT/b_suite" \
    --ids-from benchmarks/results/gpu_check_v41/a_not_reached.txt --alone "official_numerics_bounded" > "$OUT/b_suite.txt" 2>&1
  tail -40 "$OUT/b_suite.txt"
  ;;
c)
  ( for sel in dense sparse; do
      CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=8 timeout 480 python -m pytest -q -rfE --tb=short -p no:cacheprovider \
        --durations=3 "tests/models/test_v4_model.py::test_fast_model_vs_official_numerics_bounded_cuda[$sel]" \
        > "/tmp/official_$sel.log" 2>&1 &
    done
    CUDA_VISIBLE_DEVICES=1 timeout 400 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m cuda \
      tests/kernels/test_pdl.py -k "sparse_attention or tiny_model" > /tmp/pdl_tests.log 2>&1
    wait; cat /tmp/pdl_tests.log /tmp/official_dense.log /tmp/official_sparse.log > "$OUT/c_tests.log" ) &
  ATTN="pdl.PDL_LAUNCH=pdl.PDL_LAUNCH.union({'attention','attention_combine'})"
  NAMES="mma_decode,combine,attention,attention_combine"
  for round in 1 2; do
    for setting in default names; do
      if [ $setting = names ]; then export MEGAMOE_PDL_LAUNCH=$NAMES; else unset MEGAMOE_PDL_LAUNCH; fi
      CUDA_VISIBLE_DEVICES=0 timeout 150 python benchmarks/bench_attention.py --layers 8 --flush read \
        --batches 32,64 --contexts 32768,131072 --out "/tmp/attn_${setting}_$round" 2>&1 | grep -v "^{" | tail -1
      cp "/tmp/attn_${setting}_$round.md" "$OUT/c_attention_${setting}_$round.md"
    done
  done
  unset MEGAMOE_PDL_LAUNCH
  CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/ab_decode_step.py --layers 4 --batch 1,32 --rounds 6 \
    --steps 20 --settings "base|$ATTN" --tag c_attention_pdl --out "$OUT" 2>&1 | tail -8
  wait
  grep -E "passed|failed|error" "$OUT/c_tests.log"
  ;;
d)
  timeout 300 python -m pytest -q -rfE --tb=short -p no:cacheprovider --durations=5 tests/kvcache/test_large_pool.py \
    > "$OUT/d_large_pool.log" 2>&1
  tail -12 "$OUT/d_large_pool.log"
  sed -i 's/dst = tl.where(valid, page, 0).to(tl.int64) \* EPB/dst = tl.where(valid, page, 0) * EPB/' \
    megamoe/kernels/kvcache/flush.py
  git diff --stat
  timeout 200 python -m pytest -q -rfE --tb=line -p no:cacheprovider tests/kvcache/test_large_pool.py -k flush \
    > "$OUT/d_large_pool_break.log" 2>&1
  git checkout megamoe/kernels/kvcache/flush.py
  tail -5 "$OUT/d_large_pool_break.log"
  ;;
e)
  python benchmarks/run_cuda_suite.py --timeout "${SUITE_TIMEOUT:-240}" --out "$OUT/e_suite" \
    --ids-from benchmarks/results/gpu_check_v41/a_skipped.txt > "$OUT/e_suite.txt" 2>&1
  tail -12 "$OUT/e_suite.txt"
  ;;
esac
