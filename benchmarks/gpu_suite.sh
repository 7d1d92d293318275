#!/bin/bash
# The whole CUDA test suite (`pytest -m cuda`), sharded over the machine's GPUs, one pytest per GPU, then the
# multi-GPU (tests/distributed) files with every GPU visible. Logs keep the failure reports (-rfE, short tracebacks).
#   bash benchmarks/gpu_suite.sh [SHARD_TIMEOUT_S]        -> $OUT/suite_summary.txt, $OUT/suite_logs.txt
# Shards are balanced by test count per file (greedy); a file never spans two shards. Few output files: the device
# tool returns at most 8 (the first run lost two shard logs that way). Measured on 4 H100s: shards of ~125 tests take
# 310-340 s, some need more than 400 s: give ~600 s, or use 8 GPUs.
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu_suite}
WORK=/tmp/gpu_suite_work
mkdir -p "$OUT" "$WORK"
limit=${1:-480}
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$OUT/suite_summary.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/suite_summary.txt"
python -m pytest --collect-only -q -m cuda tests 2>/dev/null | grep "::" | cut -d: -f1 | sort | uniq -c \
  | sort -rn > "$WORK/suite_files.txt"
python - "$gpus" "$WORK" <<'EOF'
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
    $(cat "$WORK/suite_shard_$i.files") > "$WORK/suite_shard_$i.log" 2>&1 &
done
wait
for ((i = 0; i < gpus; i++)); do echo "shard $i ($(cat "$WORK/suite_shard_$i.files")): $(tail -1 "$WORK/suite_shard_$i.log")"; done \
  | tee -a "$OUT/suite_summary.txt"
grep -h "^FAILED\|^ERROR" "$WORK"/suite_shard_*.log | tee -a "$OUT/suite_summary.txt"
timeout 240 python -m pytest -q -m cuda -rfE --tb=short -p no:cacheprovider tests/distributed \
  > "$WORK/suite_distributed.log" 2>&1
echo "distributed: $(tail -1 "$WORK/suite_distributed.log")" | tee -a "$OUT/suite_summary.txt"
for f in "$WORK"/suite_shard_*.log "$WORK/suite_distributed.log"; do echo "######## $f"; cat "$f"; done > "$OUT/suite_logs.txt"
