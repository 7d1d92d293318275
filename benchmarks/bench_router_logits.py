"""Router logits on the tensor cores (``megamoe/kernels/router_logits.py``) vs torch's fp32 path, and the route op.

For V4-Flash (H 4096, E 256) and V4-Pro (H 7168, E 384) at several token counts: the logits alone (torch
``x.float() @ gate.float().T``; the kernel with the bf16 gate, one product per element; the kernel with an fp32 gate,
three), then ``megamoe.ops.moe.route`` (backend "triton", top-6, sqrtsoftplus, bias) with the tensor-core logits and
with the SGEMM (``ROUTER_TC_MIN_TOKENS`` raised). CUDA-graph replay, L2 cleared, ``triton.testing.do_bench`` median.
The ids of the two route variants are compared (equal except at near-ties, which the tests bound).

Run (H100): ``python benchmarks/bench_router_logits.py [--out DIR]`` -> DIR/bench_router_logits.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_replay_us  # noqa: E402 (benchmarks/)

CASES = (("V4-Flash", 4096, 256, (16, 32, 64, 128, 256, 4096)), ("V4-Pro", 7168, 384, (16, 32, 64, 128, 256, 4096)))



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from megamoe.kernels.router_logits import launch_router_logits
    from megamoe.ops import moe as moe_ops

    dev = torch.device("cuda")
    lines = [f"# Router logits and route op ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__})", "", "Command: `python " + " ".join(sys.argv) + "`. Graph replay, L2 cleared, "
             "median us."]
    from megamoe.kernels import router_logits as rl

    sweep = [(64, 32, 128, 4, 3), (64, 16, 128, 4, 3), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (128, 64, 64, 8, 4)]
    lines += ["", "Logits alone, bf16 gate, by config (BLOCK_T, BLOCK_E, BLOCK_K, warps, stages), us:", "",
              "| shape | tokens | " + " | ".join(str(c) for c in sweep) + " |", "|---|---|" + "---|" * len(sweep)]
    for name, h, e, _ in CASES:
        gate = (torch.randn(e, h, device=dev) * h ** -0.5).bfloat16()
        for t in (16, 32, 64, 128, 256):
            x = torch.randn(t, h, device=dev).bfloat16()
            out = torch.empty(t, e, device=dev)
            us = [graph_replay_us(lambda c=c: rl.launch_router_logits(x, gate, out, config=c)) for c in sweep]
            lines.append(f"| {name} | {t} | " + " | ".join(f"{u:.1f}" for u in us) + " |")
            print(lines[-1], flush=True)
    lines += ["", "| shape | tokens | logits torch fp32 | logits TC, bf16 gate | logits TC, fp32 gate | route SGEMM | "
              "route TC | route speed-up | ids differing |", "|---|---|---|---|---|---|---|---|---|"]
    saved = moe_ops.ROUTER_TC_MIN_TOKENS
    for name, h, e, tokens in CASES:
        gen = torch.Generator(device=dev).manual_seed(h)
        gate = (torch.randn(e, h, device=dev, generator=gen) * h ** -0.5).bfloat16()
        gate32 = gate.float()
        bias = torch.rand(e, device=dev, generator=gen) * 0.05
        for t in tokens:
            x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
            out = torch.empty(t, e, device=dev)
            us_torch = graph_replay_us(lambda: torch.matmul(x.float(), gate32.t(), out=out))
            us_bf16 = graph_replay_us(lambda: launch_router_logits(x, gate, out))
            us_fp32 = graph_replay_us(lambda: launch_router_logits(x, gate32, out))
            route = {}
            for label, threshold in (("sgemm", 1 << 30), ("tc", 0)):
                moe_ops.ROUTER_TC_MIN_TOKENS = threshold
                buf = (torch.empty(t, 6, device=dev), torch.empty(t, 6, dtype=torch.int32, device=dev))
                fn = lambda: moe_ops.route(x, gate, bias, top_k=6, scoring_func="sqrtsoftplus",  # noqa: E731
                                           routed_scaling_factor=1.5, backend="triton", out=buf)
                route[label] = (graph_replay_us(fn), buf[1].clone())
            moe_ops.ROUTER_TC_MIN_TOKENS = saved
            differ = int((route["sgemm"][1] != route["tc"][1]).any(dim=1).sum())
            lines.append(f"| {name} | {t} | {us_torch:.1f} | {us_bf16:.1f} | {us_fp32:.1f} | {route['sgemm'][0]:.1f} "
                         f"| {route['tc'][0]:.1f} | {route['sgemm'][0] / route['tc'][0]:.2f}x | {differ} of {t} |")
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "bench_router_logits.md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
