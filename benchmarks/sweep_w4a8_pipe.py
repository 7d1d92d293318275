"""Config sweep of the pipelined W4A8 kernel alone (issue 13, NOTES_gemm.md "w4a8 v2"): V4-Flash / V4-Pro expert
GEMMs at uniform routing, do_bench medians (L2 flushed), each config against the default in the same run.

Run: PYTHONUNBUFFERED=1 python benchmarks/sweep_w4a8_pipe.py [--configs "128,128,128,8,4;128,128,128,8,6"]
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megamoe.format.tensor import NVFP4Tensor  # noqa: E402
from megamoe.kernels.fp8_act_quant import launch_fp8_act_quant
from megamoe.kernels.gemm.nvfp4_w4a8_pipe import W4A8_PIPE_CONFIG, launch_nvfp4_w4a8_pipe
from megamoe.models.config import PRESETS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="128,128,128,8,4;128,128,128,8,6;128,128,128,8,3")
    parser.add_argument("--cases", default="v4-flash:4096,v4-flash:16384,v4-pro:8192")
    args = parser.parse_args()
    configs = [W4A8_PIPE_CONFIG] + [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        preset, tokens = case.split(":")
        c = PRESETS[preset]
        e, h, i, topk = c.num_experts, c.hidden_size, c.intermediate_size, c.top_k
        n, k = 2 * i, h  # gate_up, no SwiGLU (the epilogue is not what is swept)
        data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
        sb = torch.randint(0x20, 0x48, (e, n, k // 16), dtype=torch.uint8, device="cuda")
        w = NVFP4Tensor(data, sb.view(torch.float8_e4m3fn), torch.full((e, 1, 1), 1e-3, device="cuda"), (e, n, k))
        experts = torch.rand(int(tokens), e, generator=gen).topk(topk, dim=1).indices.flatten()
        counts = torch.bincount(experts, minlength=e)
        offsets = counts.cumsum(0).to(torch.int32).cuda()
        t = int(counts.sum())
        x = torch.randn(t, k, device="cuda").bfloat16()
        xq = torch.empty(t, k, dtype=torch.float8_e4m3fn, device="cuda")
        xs = torch.empty(t, dtype=torch.float32, device="cuda")
        launch_fp8_act_quant(x, xq, xs, mma_order=True)
        out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
        ref = None
        for cfg in configs:
            fn = lambda: launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, out,  # noqa: E731
                                                expert_offsets=offsets, config=cfg)
            try:
                fn()
                got = out.clone()
                same = "" if ref is None else (" same bits" if torch.equal(got, ref) else " DIFFERENT BITS")
                ref = got if ref is None else ref
                us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
                print(f"{preset} gate_up {tokens} tokens ({t} rows) config {cfg}: {us:.1f} us, "
                      f"{2.0 * t * n * k / us / 1e6:.0f} TFLOP/s{same}", flush=True)
            except Exception as exc:  # a config that does not fit shared memory / registers
                print(f"{preset} {tokens} config {cfg}: failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        del data, sb, w, x, xq, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
