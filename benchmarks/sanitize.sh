#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernel tests (GPU machine). Logs go to $OUT (default benchmarks/results/sanitize).
#   memcheck  : every kernel test file (tests/kernels, tests/ops, tests/kvcache, tests/layers, tests/ops/test_errors.py)
#   racecheck : a representative subset (shared-memory users: the Gluon wgmma GEMM, sparse attention, top-k)
#   synccheck : the same subset (barriers in the Gluon kernels)
# Notes printed into $OUT/README.txt:
#   * Triton/Gluon kernels are ordinary cubins, so memcheck sees their global loads/stores; the Triton
#     interpreter paths are CPU-only and are not sanitized (TRITON_INTERPRET must be unset here).
#   * racecheck/synccheck only model shared memory and __syncthreads-style barriers. The Gluon wgmma kernel
#     (nvfp4_wgmma.py) issues asynchronous wgmma reads of shared memory ordered by fence.proxy.async +
#     bar.sync; racecheck does not model the async proxy and may report false hazards there (or none at all);
#     treat its racecheck result as advisory. Kernels using TMA/mbarrier (none at present) cannot be checked.
#   * CUDA-graph replays run under memcheck (the tests capture graphs); compute-sanitizer slows kernels
#     10-100x, so the timing/benchmark tests are deselected (-k "not bench").
set -u
OUT=${OUT:-benchmarks/results/sanitize}
mkdir -p "$OUT"
unset TRITON_INTERPRET
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$CS" ]; then echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee "$OUT/README.txt"; exit 2; fi
{
  echo "compute-sanitizer: $CS ($($CS --version | tail -1))"
  date -u
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  sed -n '3,16p' "$0"
} > "$OUT/README.txt"
status=0
run() {  # tool name pytest-args...
  local tool=$1 name=$2; shift 2
  echo "== $tool $name: $*" | tee -a "$OUT/summary.txt"
  "$CS" --tool "$tool" --target-processes all --error-exitcode 99 --log-file "$OUT/${tool}_${name}.%p.log" \
     python -m pytest -q -m cuda -k "not bench" -p no:cacheprovider "$@" > "$OUT/${tool}_${name}.pytest.txt" 2>&1
  local rc=$?
  echo "   rc=$rc ($(tail -1 "$OUT/${tool}_${name}.pytest.txt"))" | tee -a "$OUT/summary.txt"
  [ $rc -ne 0 ] && status=1
}
MEMCHECK_FILES="tests/kernels tests/ops tests/kvcache tests/layers"
for f in $MEMCHECK_FILES; do run memcheck "$(basename $f)" "$f"; done
SUBSET="tests/ops/test_errors.py tests/kernels/test_nvfp4_gluon.py tests/kernels/test_sparse_attention.py tests/kernels/test_topk.py"
run racecheck subset $SUBSET
run synccheck subset $SUBSET
echo "logs: $OUT (summary.txt)"; exit $status
