"""Nsight Compute look at the sparse FP8 decode attention (issue 15): where a 32-row block's time goes.

Builds ``bench_attention.make_case`` inputs (H = 64, D = 512; CSA top-512 + 128-row window) for each
``--cases`` entry ``kind:batch:context`` and runs ``sparse_mqa_attention`` ``--calls`` times, eagerly. Profile with

    ncu --kernel-name regex:'sparse_mqa|_combine_kernel' --metrics <stall reasons, pipes, wavefronts> --csv \
        --page raw python benchmarks/probe_attention_ncu.py --cases csa:128:32768,csa:32:32768 --calls 1

(``benchmarks/gpu_check_v18.sh b``). ncu flushes the caches before each launch.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="csa:128:32768,csa:32:32768")
    p.add_argument("--calls", type=int, default=1)
    args = p.parse_args()
    import bench_attention as ba
    from megamoe.ops.attention import attention_workspace, sparse_mqa_attention

    dev = torch.device("cuda")
    for case in args.cases.split(","):
        kind, batch, context = case.split(":")
        c = ba.make_case(int(batch), int(context), kind, dev)
        K = c["entry_idx"].shape[1]
        ws = attention_workspace(int(batch), ba.H, ba.D, ba.WINDOW, K, dev)
        out = torch.empty_like(c["q"])
        kw = {k: v for k, v in c.items() if k not in ("q", "attn_sink")}
        for _ in range(args.calls):
            sparse_mqa_attention(c["q"], c["attn_sink"], ba.D ** -0.5, out=out, workspace=ws, **kw)
        torch.cuda.synchronize()
        print(f"{case}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
