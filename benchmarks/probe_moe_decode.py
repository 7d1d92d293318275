"""Where the decode-sized MoE layer spends its time (issue 11): graph replay time and the kernels of one replay.

``Nvfp4MoE.random`` at V4-Flash / V4-Pro dimensions (w4a16 unless ``--mode``, default flags), x random; per token count: the layer's
CUDA-graph replay median (L2 cleared before each replay, ``triton.testing.do_bench``) and, under the torch profiler,
the kernels of one replay with their device time (L2 warm there: the sum is a lower bound of the replay). x is
seeded by the token count (since 2026-11-26 part 12; the earlier files of gpu_check_v23 used unseeded inputs).

Run (H100): ``python benchmarks/probe_moe_decode.py [--tokens 1,8] [--configs v4-flash,v4-pro] [--out DIR]
[--row-interleave 4] [--mode w4a8] [--routing all-on-k] [--tag T]`` -> DIR/probe_moe_decode[_T].md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--row-interleave", type=int, default=1, help="Nvfp4MoE(row_interleave=...): 1 or 4")
    ap.add_argument("--tag", default="")
    ap.add_argument("--mode", default="w4a16", help="Nvfp4MoE(mode=...): w4a16, w4a8 or w4a4")
    ap.add_argument("--routing", default="router",
                    help="router (the layer's own, near uniform) or a forced routing of bench_moe_skew.py: uniform, "
                         "zipf, all-on-k")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    dev = torch.device("cuda")
    lines = [f"# Decode MoE layer: replay time and kernels ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__})", "", "Command: `python " + " ".join(sys.argv) + "`.", ""]
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(int(v) for v in args.tokens.split(",")),
                                row_interleave=args.row_interleave, mode=args.mode)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, c.hidden_size, device=dev, generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            if args.routing != "router":
                from bench_moe_skew import _force_routing, routing

                weights, ids = (v.to(dev) for v in routing(args.routing, t, c.num_experts, c.top_k,
                                                            torch.Generator().manual_seed(t)))
                _force_routing(layer, weights, ids)
            layer(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                layer(x)
            us = triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3
            g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels.sort(key=lambda e: e.time_range.start)
            busy = sum(e.time_range.elapsed_us() for e in kernels)
            span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
            lines += [f"## {name}, {t} tokens, routing {args.routing}: {us:.1f} us (replay median, L2 cleared); {len(kernels)} kernels, "
                      f"{busy:.1f} us busy over a {span:.1f} us span (profiled replay, L2 warm)", "",
                      "| # | kernel | us | gap before us |", "|---|---|---|---|"]
            prev_end = None
            for i, e in enumerate(kernels):
                gap = "" if prev_end is None else f"{e.time_range.start - prev_end:.1f}"
                lines.append(f"| {i} | `{e.name[:80]}` | {e.time_range.elapsed_us():.1f} | {gap} |")
                prev_end = e.time_range.end
            lines.append("")
            print("\n".join(lines[-(len(kernels) + 4):]), flush=True)
        del layer
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    name = "probe_moe_decode" + (f"_{args.tag}" if args.tag else "")
    open(os.path.join(args.out, name + ".md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
