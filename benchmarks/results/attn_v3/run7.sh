#!/bin/bash
# v3 + the next block's cp.async (rope / window rows) issued a block ahead: check, timeline, timing vs v2
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/validate_attention_ws.py --variants ws3 --quick --no-timing --timeout 60 --out $OUT/check 2>&1 | grep -v "^{" | grep -v "^PASS" | tail -4
python benchmarks/probe_attention_blocks.py --timeline --batches 32,128 --entries 512,1024 --out $OUT/timeline 2>&1 | tail -6
python benchmarks/validate_attention_ws.py --variants ws1,ws3 --no-check --batches 32,64,128 --contexts 32768,131072 --timeout 60 --out $OUT/time 2>&1 | tail -12
