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
esac
