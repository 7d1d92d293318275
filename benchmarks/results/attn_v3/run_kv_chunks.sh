#!/bin/bash
# attention v3, KV_CHUNKS = 1 vs 8 in one call (2026-11-26, part 10): bits + graph-replay A/B of the main kernel,
# the chunked build's CUDA tests with KV_CHUNKS = 8 made the default (the file is edited, and restored on exit), then the
# partition timeline of both configs
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python benchmarks/ab_attention_ws3_config.py --b KV_CHUNKS=8 --out $OUT/c1_ab_kv_chunks 2>&1 | tail -13
timeout 60 python -m pytest -q tests/kernels/test_sparse_attention_ws3.py -m cuda -k chunked 2>&1 | tail -2
cp megamoe/kernels/sparse_attention_ws3.py /tmp/ws3_default_copy.py
trap 'cp /tmp/ws3_default_copy.py megamoe/kernels/sparse_attention_ws3.py' EXIT  # the checkout is left as it was
sed -i 's/"KV_CHUNKS": 1}/"KV_CHUNKS": 8}/' megamoe/kernels/sparse_attention_ws3.py
grep -c '"KV_CHUNKS": 8}' megamoe/kernels/sparse_attention_ws3.py
timeout 150 python -m pytest -q tests/kernels/test_sparse_attention_ws3.py tests/ops/test_attention.py -m cuda 2>&1 | tail -3
python benchmarks/probe_attention_blocks.py --timeline --config KV_CHUNKS=1,KV_CHUNKS=8 --batches 128 --entries 512,1024 --out $OUT/c2_timeline_kv_chunks 2>&1 | tail -7
