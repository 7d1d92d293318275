#!/bin/bash
# after the test/helper refactors: the v2 / v3 attention test files on the GPU; then PDL off / on for v3 (one run)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 250 python -m pytest -q tests/kernels/test_sparse_attention_ws3.py tests/kernels/test_sparse_attention_ws.py -m "cuda or slow or not cuda" 2>&1 | tail -3
python benchmarks/validate_attention_ws.py --variants ws3 --no-check --batches 32,64,128 --contexts 32768 --timeout 60 --out $OUT/pdl0 2>&1 | tail -7
MEGAMOE_PDL=1 python benchmarks/validate_attention_ws.py --variants ws3 --no-check --batches 32,64,128 --contexts 32768 --timeout 60 --out $OUT/pdl1 2>&1 | tail -7
