"""Decode router + dispatch: the unfused path (torch gate GEMM + scoring, router top-k kernel, dispatch kernel)
vs the fused one-launch ``megamoe.ops.moe.route_dispatch``, CUDA-graph replay medians (triton.testing.do_bench).

Usage: python benchmarks/bench_route.py [--tokens 1,8,64] [--out benchmarks/results/route_v1.md]
Shapes: V4-Flash (E=256, H=4096) and V4-Pro (E=384, H=7168), k=6, sqrtsoftplus, bias, fused shared slot (E+1 groups).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"v4-flash": (256, 4096), "v4-pro": (384, 7168)}


def _graph_time(fn):
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3  # us


def main():
    from megamoe.layers.moe import dispatch_buffers
    from megamoe.ops import moe as moe_ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gate-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="the gate as the layer holds it (bf16 since 2026-11-26; fp32 before)")
    ap.add_argument("--split-min-tokens", type=int, default=None,
                    help="moe_route_dispatch.SPLIT_H_MIN_TOKENS for this run (A/B of the GEMV plan)")
    ap.add_argument("--paired", action="store_true",
                    help="also time the fused launch writing x in the paired order (x_paired_out; issue 11) and "
                         "print the compiled variants' registers / spills")
    args = ap.parse_args()
    if args.split_min_tokens:
        from megamoe.kernels import moe_route_dispatch

        moe_route_dispatch.SPLIT_H_MIN_TOKENS = args.split_min_tokens
    moe_ops.FUSED_ROUTE_MAX_TOKENS = 1 << 30  # measure the fused launch at every size, whatever the layer's limit
    k = 6
    lines = [f"# route + dispatch, {datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}",
             "", f"Command: `python {' '.join(sys.argv)}`", "", "| shape | tokens | unfused (us) | fused (us) | speed-up |", "|---|---|---|---|---|"]
    for name, (e, h) in SHAPES.items():
        gate = (torch.randn(e, h, device="cuda") * h ** -0.5).bfloat16()
        gate = gate.float() if args.gate_dtype == "fp32" else gate
        bias = torch.rand(e, device="cuda") * 0.1
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda").bfloat16()
            wb = torch.ones(t, k + 1, device="cuda")
            ib = torch.full((t, k + 1), e, dtype=torch.int32, device="cuda")
            bufs = dispatch_buffers(t * (k + 1), e + 1, "cuda")
            kw = dict(top_k=k, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_groups=e + 1,
                      slots=k + 1, out=(wb, ib), buffers=bufs)

            def unfused():
                moe_ops.route(x, gate, bias, top_k=k, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                              backend="triton", out=(wb, ib))
                moe_ops.dispatch(ib, e + 1, buffers=bufs, backend="triton" if t * (k + 1) <= 512 else "torch")

            def fused():
                moe_ops.route_dispatch(x, gate, bias, **kw)

            a, b = _graph_time(unfused), _graph_time(fused)
            lines.append(f"| {name} | {t} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
            if args.paired:
                xp = torch.empty_like(x)
                c = _graph_time(lambda: moe_ops.route_dispatch(x, gate, bias, x_paired_out=xp, **kw))
                lines[-1] += f" fused + paired x: {c:.1f} us ({b / c:.3f}x of fused) |"
            print(lines[-1], flush=True)
    if args.paired:
        from megamoe.kernels.moe_route_dispatch import _route_dispatch_kernel

        for cache in _route_dispatch_kernel.device_caches.values():
            for key, compiled in cache[0].items():
                try:
                    paired = dict(compiled.src.constants).get("PAIRED_X", "?")
                except Exception:  # the compiled kernel's source record differs between Triton versions
                    paired = "?"
                lines.append(f"- compiled variant: PAIRED_X {paired}, registers {getattr(compiled, 'n_regs', '?')}, "
                             f"spills {getattr(compiled, 'n_spills', '?')}, key {str(key)[-60:]}")
                print(lines[-1])
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
