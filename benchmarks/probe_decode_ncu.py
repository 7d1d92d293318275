"""Nsight Compute look at the 1-token grouped decode GEMMs (issue 11): why the V4-Flash gate_up / down kernels
read their weights at ~1.25 TB/s. Launches each GEMM 3 times eagerly (V4-Flash shapes, top-6 of 256, one token,
random routing); profile the last launch of each with

    ncu --kernel-name regex:mma_decode --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
        python benchmarks/probe_decode_ncu.py

(ncu flushes the caches before each profiled launch by default: weights are cold, as in the benchmarks.)
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from gemm_helpers import random_codes_weight  # noqa: E402
from megamoe.ops import gemm as ops_gemm  # noqa: E402

H, I, E, TOP_K = 4096, 2048, 256, 6
dev = torch.device("cuda")
w13 = random_codes_weight((E, 2 * I, H), dev, scale_shape=(E, 1, 1))
w2 = random_codes_weight((E, H, I), dev, scale_shape=(E, 1, 1))
ids = torch.randperm(E)[:TOP_K]
counts = torch.bincount(ids, minlength=E)
offsets = counts.cumsum(0).to(torch.int32).to(dev)
row_index = torch.zeros(TOP_K, dtype=torch.int32, device=dev)
x = torch.randn(1, H, device=dev).bfloat16()
inter = torch.randn(TOP_K, I, device=dev).bfloat16()
for _ in range(3):
    ops_gemm.nvfp4_grouped_mm(x, w13, offsets, row_index=row_index, activation="swiglu", swiglu_limit=10.0,
                              max_rows_per_expert=1)
    ops_gemm.nvfp4_grouped_mm(inter, w2, offsets, max_rows_per_expert=1)
torch.cuda.synchronize()
print("plan gate_up:", ops_gemm.plan_row_bands(TOP_K, E, H, 1))
