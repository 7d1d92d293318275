#!/bin/bash
# attention v3: CUDA tests (its own file; the attention suites with MEGAMOE_ATTN_IMPL=ws3), small-batch timing
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python -m pytest -q tests/kernels/test_sparse_attention_ws3.py -m "cuda or slow or not cuda" 2>&1 | tail -4
MEGAMOE_ATTN_IMPL=ws3 timeout 250 python -m pytest -q -x tests/kernels/test_sparse_attention.py tests/ops/test_attention.py tests/layers/test_attention_layer.py tests/layers/test_attention_simulation.py -m cuda 2>&1 | tail -4
python benchmarks/validate_attention_ws.py --variants ws1,ws3 --no-check --batches 1,8 --contexts 32768,131072 --timeout 60 --out $OUT/time_small 2>&1 | tail -10
