"""A/B of one pipelined band config inside the whole MoE layer (issue 10): ``Nvfp4MoE.random`` (V4-Flash / V4-Pro,
w4a16, its own router on random x), CUDA-graph replay of the layer with ``nvfp4_wgmma_pipe.PIPE_SMALL_CONFIGS[band]``
set to config A, then B, alternated ``--repeats`` times (``graph_timing.graph_replay_us``: L2 cleared, median), and
whether both write the same bits.

Run (H100): ``python benchmarks/ab_moe_band_config.py --band 16 --a 16,128,128,4,6,2 --b 16,128,128,4,8,2
[--tokens 512,1024] [--configs v4-flash,v4-pro] [--out DIR] [--tag T]`` -> DIR/ab_moe_band_config[_T].md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timing import graph_replay_us  # noqa: E402 (benchmarks/)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--band", type=int, default=16)
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--tokens", default="512,1024")
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    dev = torch.device("cuda")
    variants = {"A": tuple(int(v) for v in args.a.split(",")), "B": tuple(int(v) for v in args.b.split(","))}
    saved = pipe.PIPE_SMALL_CONFIGS[args.band]
    lines = [f"# MoE layer with PIPE_SMALL_CONFIGS[{args.band}] = A / B ({torch.cuda.get_device_name()}, torch "
             f"{torch.__version__})", "", "Command: `python " + " ".join(sys.argv) + "`", "",
             f"A = {variants['A']}, B = {variants['B']}; graph replay median us (L2 cleared), median of "
             f"{args.repeats} alternations.", "", "| config | tokens | A us | B us | B / A | same bits |",
             "|---|---|---|---|---|---|"]
    tokens = [int(v) for v in args.tokens.split(",")]
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        for t in tokens:
            x = torch.randn(t, c.hidden_size, device=dev, generator=torch.Generator(device=dev).manual_seed(t))
            x = x.bfloat16()
            runs, outs = {k: [] for k in variants}, {}
            try:
                for _ in range(args.repeats):
                    for key, cfg in variants.items():
                        pipe.PIPE_SMALL_CONFIGS[args.band] = cfg
                        runs[key].append(graph_replay_us(lambda: layer(x)))
                        outs[key] = layer(x).clone()
            finally:
                pipe.PIPE_SMALL_CONFIGS[args.band] = saved
            a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
            lines.append(f"| {name} | {t} | {a:.1f} | {b:.1f} | {b / a:.3f} | {torch.equal(outs['A'], outs['B'])} |")
            print(lines[-1], flush=True)
        layer = None
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_moe_band_config" + (f"_{args.tag}" if args.tag else "") + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
