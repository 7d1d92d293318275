#!/bin/bash
# attention v3 + L2 prefetch of the next block + Q load after the fork + staged bf16 output: check, timeline, timing
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/validate_attention_ws.py --variants ws3 --quick --no-timing --timeout 60 --out $OUT/check 2>&1 | grep -v "^{" | grep -v "^PASS" | tail -8
python benchmarks/probe_attention_blocks.py --timeline --batches 32,128 --entries 0,512,1024 --out $OUT/timeline 2>&1 | tail -8
python benchmarks/validate_attention_ws.py --variants ws1,ws3 --no-check --batches 32,64,128 --contexts 32768,131072 --timeout 60 --out $OUT/time 2>&1 | tail -12
