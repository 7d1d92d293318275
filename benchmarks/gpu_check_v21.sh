# GPU check v21 (2026-11-26, part 11). Modes:
#   suite   -> the whole CUDA suite sharded over the machine's GPUs (benchmarks/gpu_suite.sh), on a multi-GPU kind
#   timing  -> one GPU: attention v3 KV_CHUNKS = 1 vs 8 (issue 15) and the dense M = 1 / 8 weight-ring sweep (issue 11)
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu_check_v21}
mkdir -p "$OUT"
case "$1" in
suite)
  OUT="$OUT" bash benchmarks/gpu_suite.sh "${2:-420}" 2>&1 | tail -30 ;;
timing)
  OUT="$OUT" bash benchmarks/results/attn_v3/run_kv_chunks.sh 2>&1 | tee "$OUT/b_kv_chunks.log" | tail -40
  timeout 240 python benchmarks/sweep_dense_ring.py --out "$OUT" 2>&1 | tail -12 ;;
*)
  echo "usage: bash benchmarks/gpu_check_v21.sh suite|timing" >&2; exit 2 ;;
esac
