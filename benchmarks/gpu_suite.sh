#!/bin/bash
# The whole CUDA test suite (`pytest -m cuda`), sharded over the machine's GPUs, one pytest per GPU, then the
# multi-GPU (tests/distributed) files with every GPU visible. Logs keep the failure reports (-rfE, short tracebacks).
#   bash benchmarks/gpu_suite.sh [SHARD_TIMEOUT_S]        -> $OUT/suite_shard_<i>.log, $OUT/suite_distributed.log
# Shards are balanced by test count per file (greedy); a file never spans two shards.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu_suite}
mkdir -p "$OUT"
limit=${1:-480}
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$OUT/suite_devices.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/suite_devices.txt"
python -m pytest --collect-only -q -m cuda tests 2>/dev/null | grep "::" | cut -d: -f1 | sort | uniq -c \
  | sort -rn > "$OUT/suite_files.txt"
python - "$gpus" "$OUT" <<'EOF'
import sys
gpus, out = int(sys.argv[1]), sys.argv[2]
files = [line.split() for line in open(f"{out}/suite_files.txt")]
shards = [[0, []] for _ in range(gpus)]
for count, path in files:
    if path.startswith("tests/distributed/"):
        continue
    shard = min(shards, key=lambda s: s[0])
    shard[0] += int(count)
    shard[1].append(path)
for i, (_, paths) in enumerate(shards):
    open(f"{out}/suite_shard_{i}.files", "w").write(" ".join(paths))
EOF
for ((i = 0; i < gpus; i++)); do
  CUDA_VISIBLE_DEVICES=$i timeout "$limit" python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider \
    $(cat "$OUT/suite_shard_$i.files") > "$OUT/suite_shard_$i.log" 2>&1 &
done
wait
for ((i = 0; i < gpus; i++)); do echo "shard $i: $(tail -1 "$OUT/suite_shard_$i.log")"; done
grep -h "^FAILED\|^ERROR" "$OUT"/suite_shard_*.log
timeout 240 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/distributed \
  > "$OUT/suite_distributed.log" 2>&1
echo "distributed: $(tail -1 "$OUT/suite_distributed.log")"
