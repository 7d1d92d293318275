# GPU check v26 (2026-11-26, part 15).
#   a -> the README test command on the GPU machine, the whole suite (cuda-marked or not), after part 14's fixes for
#        tests that only the CPU interpreter can run; pytest-xdist (in the machine's image) spreads it over 8 workers
#        so it ends inside one call.
#   b -> the tile lists (issue 10's device-side schedule, NOTES_gemm.md v24): the bands above 32 rows as two persistent
#        launches over device-built lists of 128 / 64-row and 96-row tiles instead of five band launches. CUDA tests of
#        the pipelined kernel and the bands, then routed experts with PIPE_LIST off / on and the peer, 512-8192 tokens.
#   c -> b's test run stopped at its time limit after 40 passing tests, before the tile-list CUDA tests: those, and the
#        bands' CUDA tests.
#   d -> a again, with names: the whole suite less the offline-compile ("slow", CPU-only) tests, 12 workers, -v so each
#        result prints with its name as it lands.
#   f -> after the fixes for e (the indexer's relu keeps NaN on the GPU; the fused top-k test's workspace checks only
#        where the plan has a workspace): the suite's tests d did not reach (f_rest_ids.txt), e's tests again, and the
#        EP bit-equality test under pinned CPU code paths (ATen's vector ISA, MKL's) to find why it differs here.
#   g -> f's run of the remaining test ids collected nothing (the ids list): the files that hold them instead, and the EP
#        tests with the ranks' MKL pinned to its AVX2 path (tests/distributed/ep_workers.py; f: that alone passes).
#   h -> list kernels v2: programs take items from an atomic counter (dynamic), and list B's kernel starts on the SMs list
#        A's programs free (PDL: A triggers at once, B waits for A only before exiting). Tile-list CUDA tests and the
#        CLI CPU-job tests (now with the GPU hidden), then b's benchmark again (bands vs lists v2 in one run).
#   i -> the EP bit-equality test on this machine's AVX-512 CPU under pinned code paths, three fixed seeds each: ATen's
#        vector ISA, oneDNN's, and both with MKL's (f's passes drew one random seed each).
# Run with carry [".peers"] (the peer). At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v26}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 560 python -m pytest -q -rfE --tb=short -p no:cacheprovider -n 8 --durations=25 tests > "$OUT/a_tests.log" 2>&1
  echo "pytest rc=$?"
  grep -E "^FAILED|^ERROR" "$OUT/a_tests.log" | head -30; tail -3 "$OUT/a_tests.log" ;;
b)
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_wgmma_pipe.py tests/ops/test_gemm_bands.py > "$OUT/b_tests.log" 2>&1
  tail -3 "$OUT/b_tests.log"
  timeout 200 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,2048,4096,8192 \
    --routings uniform,zipf,all-on-k --interleaved --both-list --no-bf16 --rep-ms 40 --budget-s 180 \
    --out-dir "$OUT" --tag b_list_flash 2>&1 | grep -v "^  " | tail -2
  timeout 160 python benchmarks/bench_peer.py --configs v4-pro --tokens 2048,4096 --routings uniform,zipf,all-on-k \
    --interleaved --both-list --no-bf16 --rep-ms 40 --budget-s 140 --out-dir "$OUT" --tag b_list_pro \
    2>&1 | grep -v "^  " | tail -2 ;;
c)
  timeout 400 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_wgmma_pipe.py -k "tile_list" tests/ops/test_gemm_bands.py > "$OUT/c_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR" "$OUT/c_tests.log" | grep -i "list\|FAIL\|ERROR" | head; tail -2 "$OUT/c_tests.log" ;;
d)
  timeout 540 python -m pytest -v -rfE --tb=line -p no:cacheprovider -n 12 -m "not slow" tests > "$OUT/d_tests.log" 2>&1
  echo "pytest rc=$?"
  grep -E " (FAILED|ERROR) " "$OUT/d_tests.log" | head -30; grep -cE " PASSED " "$OUT/d_tests.log"; tail -2 "$OUT/d_tests.log" ;;
f)
  timeout 280 python -m pytest -v -rfE --tb=short -p no:cacheprovider -n 8 $(cat benchmarks/results/gpu_check_v26/f_rest_ids.txt) \
    > "$OUT/f_rest.log" 2>&1
  grep -E " (FAILED|ERROR) " "$OUT/f_rest.log" | head -20; tail -1 "$OUT/f_rest.log"
  timeout 60 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/kvcache/test_indexer_kernel.py \
    tests/kvcache/test_indexer_topk.py > "$OUT/f_indexer.log" 2>&1; tail -1 "$OUT/f_indexer.log"
  python -c "import torch; print('cpu capability', torch.backends.cpu.get_cpu_capability())"
  for env in "X=1" "ATEN_CPU_CAPABILITY=avx2" "MKL_CBWR=AVX2" "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2"; do
    env $env timeout 100 python -m pytest -q -p no:cacheprovider --tb=no \
      "tests/distributed/test_ep_generate.py::test_generate_matches_single_process_bit_for_bit[2]" 2>&1 | tail -1 \
      | sed "s/^/$env: /"
  done ;;
g)
  timeout 330 python -m pytest -v -rfE --tb=short -p no:cacheprovider -n 10 -m "not slow" \
    tests/kernels/test_quantize_kernels.py tests/kvcache/test_kvcache_reliability.py \
    tests/kvcache/test_kvcache_steps.py tests/models/test_v4_model.py tests/models/test_v4_weights.py \
    tests/ops/test_attention.py tests/ops/test_gemm.py tests/ops/test_gemm_bands.py \
    tests/ops/test_hyper_connection.py tests/ops/test_moe_hash_routing.py tests/ops/test_moe_op_validation.py \
    tests/ops/test_moe_ops.py tests/ops/test_moe_route_dispatch.py tests/ops/test_quantize.py \
    tests/ops/test_sampling.py tests/ops/test_v4_elementwise_validation.py \
    tests/reference/test_quantize_reference.py tests/reference/test_v4_reference.py \
    tests/test_bench_moe_skew.py tests/test_bench_peer.py tests/test_cli.py > "$OUT/g_rest.log" 2>&1
  grep -E " (FAILED|ERROR) " "$OUT/g_rest.log" | head -20; tail -1 "$OUT/g_rest.log"
  timeout 200 python -m pytest -q -rfE --tb=short -p no:cacheprovider tests/distributed/test_ep_generate.py \
    > "$OUT/g_ep.log" 2>&1; tail -3 "$OUT/g_ep.log" ;;
h)
  timeout 150 python -m pytest -q -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_wgmma_pipe.py -k "tile_list or cpu_default" tests/test_cli.py > "$OUT/h_tests.log" 2>&1
  tail -2 "$OUT/h_tests.log"
  timeout 200 python benchmarks/bench_peer.py --configs v4-flash --tokens 512,2048,4096,8192 \
    --routings uniform,zipf,all-on-k --interleaved --both-list --no-bf16 --rep-ms 40 --budget-s 180 \
    --out-dir "$OUT" --tag h_list2_flash 2>&1 | grep -v "^  " | tail -1
  timeout 160 python benchmarks/bench_peer.py --configs v4-pro --tokens 2048,4096 --routings uniform,zipf,all-on-k \
    --interleaved --both-list --no-bf16 --rep-ms 40 --budget-s 140 --out-dir "$OUT" --tag h_list2_pro \
    2>&1 | grep -v "^  " | tail -1 ;;
i)
  for env in "X=1" "ATEN_CPU_CAPABILITY=avx2" "ONEDNN_MAX_CPU_ISA=AVX2" \
             "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2"; do
    for seed in 11 22 33; do
      env $env MEGAMOE_TEST_SEED=$seed timeout 60 python -m pytest -q -p no:cacheprovider --tb=no \
        "tests/distributed/test_ep_generate.py::test_generate_matches_single_process_bit_for_bit[2]" 2>&1 \
        | tail -1 | sed "s/^/$env seed $seed: /"
    done
  done ;;
esac
