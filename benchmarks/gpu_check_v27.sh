# GPU check v27 (2026-11-26, part 16).
#   a -> w4a8 v2 (issue 13, NOTES_gemm.md "w4a8 v2"): the pipelined FP8 kernel's CUDA tests and the w4a8 tests that
#        now route through it, then bench_gemm.py --w4a8 (w4a16, the op, the v1 and v2 kernels alone, in one run).
#   b -> after a: the Gluon SwiGLU epilogue's clamp keeps NaN (it was min.f32, which returns the limit for NaN: found by
#        a's new NaN test); the GEMM kernel tests (cuda-marked or not, 8 workers) and the bands' new NaN test; then the
#        v2 kernel's ring depth (STAGES 3-6) on V4-Flash / V4-Pro gate_up.
#   c -> b's sweep again (its script lacked the checkout's sys.path); the two w4a8 test files after the far-fraction
#        bound of the SwiGLU test (b: 1.2% of 23136 outputs beyond 2**-7 relative, all within the absolute bound).
# Run with carry [".peers"] (the peer). At most 8 output files (the device tool's limit).
export PYTHONUNBUFFERED=1
export MEGAMOE_PEERS=${MEGAMOE_PEERS:-$PWD/.peers}
OUT=${OUT:-benchmarks/results/gpu_check_v27}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
a)
  timeout 200 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py tests/kernels/gemm/test_nvfp4_w4a8.py > "$OUT/a_tests.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/a_tests.log" | head -20; tail -2 "$OUT/a_tests.log"
  timeout 330 python benchmarks/bench_gemm.py --w4a8 --rep-ms 40 --out-dir "$OUT" --tag a_w4a8_v2 2>&1 | tail -12 ;;
b)
  timeout 400 python -m pytest -v -rfE --tb=short -p no:cacheprovider -n 8 -m "not slow" tests/kernels/gemm \
    tests/ops/test_gemm_bands.py > "$OUT/b_tests.log" 2>&1
  echo "pytest rc=$?"; grep -E " (FAILED|ERROR) " "$OUT/b_tests.log" | head -20; tail -2 "$OUT/b_tests.log"
  timeout 150 python benchmarks/sweep_w4a8_pipe.py 2>&1 | tee "$OUT/b_sweep.log" | tail -14 ;;
c)
  timeout 120 python -m pytest -v -rfE --tb=short -p no:cacheprovider -m "not slow" \
    tests/kernels/gemm/test_nvfp4_w4a8_pipe.py tests/kernels/gemm/test_nvfp4_w4a8.py > "$OUT/c_tests.log" 2>&1
  grep -E " (FAILED|ERROR)" "$OUT/c_tests.log" | head; tail -1 "$OUT/c_tests.log"
  timeout 200 python benchmarks/sweep_w4a8_pipe.py 2>&1 | tee "$OUT/c_sweep.log" | tail -14 ;;
esac
