#!/bin/bash
# attention v3 first GPU run: correctness (quick grid + edge cases) then timing, v2 (ws1) vs v3 (ws3)
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/validate_attention_ws.py --variants ws1,ws3 --quick --no-timing --timeout 60 --out $OUT/check 2>&1 | grep -v "^{" | tail -30
python benchmarks/validate_attention_ws.py --variants ws1,ws3 --no-check --batches 32,64,128 --contexts 32768,131072 --timeout 60 --out $OUT/time 2>&1 | tail -12
