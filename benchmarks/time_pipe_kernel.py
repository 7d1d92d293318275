"""Time the pipelined wgmma kernel alone at its defaults (for A/B between two checkouts, one process each).

V4-Flash at 4096 tokens: gate_up + SwiGLU (rows gathered by ``row_index``) and down, all tokens on 6 experts and
uniform over 256 experts; x already in the MMA K order; CUDA-graph replay, L2 cleared, ``do_bench`` median.
Prints one JSON line per case and the output checksum (equal checksums = the same bits across checkouts).
Run: ``python benchmarks/time_pipe_kernel.py [--tag NAME]`` from the checkout to time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, INTER, TOKENS, TOPK = 4096, 2048, 4096, 6


def flash_cases(device, tokens=TOKENS, routings=("all-on-6", "uniform")):
    """Yield (routing, gemm, n, k, flops, launch kwargs for ``launch_nvfp4_wgmma_pipe``) of the V4-Flash GEMMs at
    ``tokens`` (also used by ab_pipe_wait_depth.py and ab_pipe_tail.py): "all-on-6" (every token on 6 experts) and
    "uniform" (tokens * 6 / 256 rows per expert, every expert the same), x in the MMA K order, ``out``
    preallocated, fixed random data."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order

    gen = torch.Generator(device=device).manual_seed(0)
    for routing, experts in (("all-on-6", TOPK), ("uniform", 256)):
        if routing not in routings:
            continue
        per = tokens * TOPK // experts
        offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per
        row_index = torch.randint(0, tokens, (tokens * TOPK,), dtype=torch.int32, device=device, generator=gen)
        for gemm, n, k, src, swiglu in (("gate_up", 2 * INTER, HIDDEN, tokens, True),
                                        ("down", HIDDEN, INTER, tokens * TOPK, False)):
            data = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
            scale = torch.randint(0x20, 0x48, (experts, n, k // 16), dtype=torch.uint8, device=device,
                                  generator=gen).view(torch.float8_e4m3fn)
            w = NVFP4Tensor(data, scale, torch.full((experts, 1, 1), 1e-3, device=device), (experts, n, k))
            x = launch_to_mma_k_order(torch.randn(src, k, device=device, generator=gen).bfloat16())
            out = torch.empty(tokens * TOPK, n // 2 if swiglu else n, dtype=torch.bfloat16, device=device)
            yield routing, gemm, n, k, 2 * tokens * TOPK * n * k, dict(
                x=x, data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, out=out,
                expert_offsets=offsets, row_index=row_index if swiglu else None, swiglu=swiglu,
                swiglu_limit=7.0 if swiglu else None, x_in_mma_order=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

    for routing, gemm, n, k, flops, kwargs in flash_cases(torch.device("cuda")):
        pipe.launch_nvfp4_wgmma_pipe(**kwargs)
        torch.cuda.synchronize()
        checksum = float(kwargs["out"].float().abs().sum())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pipe.launch_nvfp4_wgmma_pipe(**kwargs)
        us = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3
        print(json.dumps(dict(tag=args.tag, routing=routing, gemm=gemm, us=round(us, 1),
                              tflops=round(flops / us / 1e6, 1), checksum=checksum)), flush=True)
        graph = kwargs = None


if __name__ == "__main__":
    main()
