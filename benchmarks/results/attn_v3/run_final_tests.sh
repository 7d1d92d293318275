#!/bin/bash
# attention v3 final: CUDA tests (its file incl. the offline-compile test; the attention suites and the tiny-model
# GPU tests with the default main kernel, ws3), then the timeline of the final config
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 200 python -m pytest -q tests/kernels/test_sparse_attention_ws3.py tests/kernels/test_sparse_attention_ws.py -m "cuda or slow or not cuda" 2>&1 | tail -3
timeout 200 python -m pytest -q tests/kernels/test_sparse_attention.py tests/kernels/test_sparse_attention_bf16p.py tests/ops/test_attention.py tests/layers/test_attention_layer.py tests/layers/test_attention_layer_errors.py tests/layers/test_attention_simulation.py -m cuda 2>&1 | tail -3
timeout 240 python -m pytest -q tests/models/test_v4_model.py -m cuda 2>&1 | tail -3
python benchmarks/probe_attention_blocks.py --timeline --batches 32,64,128 --entries 0,512,1024 --out $OUT/timeline_final 2>&1 | tail -11
