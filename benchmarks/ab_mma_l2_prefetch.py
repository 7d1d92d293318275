"""A/B of the decode GEMM's L2 prefetch distance (issue 11; NOTES_gemm.md v25): the MoE layer at decode sizes.

``Nvfp4MoE.random`` (w4a16, default flags: row-interleaved weights, the mma.sync decode kernel at 1-64 tokens) per
config and token count, captured once per prefetch distance D (``nvfp4_mma_decode.MMA_L2_PREFETCH``; 0 = today's
kernel). Each capture's replay is timed with ``triton.testing.do_bench`` (L2 cleared before every replay, median);
the distances run in ``--rounds`` interleaved rounds, so drift shows as round-to-round spread. Every capture's
output must equal D = 0's bit for bit (the prefetch moves no math); a mismatch is reported and fails the run.

Run (H100): ``python benchmarks/ab_mma_l2_prefetch.py [--configs v4-flash,v4-pro] [--tokens 1,2,4,8,16,64]
[--distances 0,3,6,12] [--rounds 2] [--out DIR] [--tag T]`` -> DIR/ab_mma_l2_prefetch[_T].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--distances", default="0,3,6,12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    dev = torch.device("cuda")
    tokens = [int(v) for v in args.tokens.split(",")]
    distances = [int(v) for v in args.distances.split(",")]
    assert distances[0] == 0, "the first distance is the baseline (0)"
    rows, ok = [], True
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        for t in tokens:
            x = torch.randn(t, c.hidden_size, device=dev,
                            generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            graphs, outs = {}, {}
            for d in distances:
                mma.MMA_L2_PREFETCH = d
                layer(x)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = layer(x)
                g.replay()
                torch.cuda.synchronize()
                graphs[d], outs[d] = g, y.clone()
            mma.MMA_L2_PREFETCH = 0
            times = {d: [] for d in distances}
            for _ in range(args.rounds):
                for d in distances:
                    times[d].append(triton.testing.do_bench(graphs[d].replay, warmup=20, rep=150,
                                                            return_mode="median") * 1e3)
            base = statistics.median(times[0])
            for d in distances:
                same = bool(torch.equal(outs[d], outs[0]))
                ok &= same
                us = statistics.median(times[d])
                rows.append(dict(config=name, tokens=t, distance=d, us=us, rounds=times[d], speedup=base / us,
                                 same_bits=same))
                print(f"{name} T={t} D={d}: {us:.1f} us ({base / us:.3f}x) rounds "
                      f"{[round(v, 1) for v in times[d]]} same bits {same}", flush=True)
            del graphs, outs
        del layer
        torch.cuda.empty_cache()
    tag = f"_{args.tag}" if args.tag else ""
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv))
    with open(os.path.join(args.out, f"ab_mma_l2_prefetch{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Decode GEMM L2 prefetch distance: MoE layer graph replay ({meta['device']})", "",
             f"- date {meta['date']}; torch {meta['torch']}; triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             "- do_bench median of graph replays, L2 cleared before each; median over the interleaved rounds; "
             "speed-up = D 0 / D", "",
             "| config | tokens | D | us | speed-up | rounds | same bits as D 0 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['tokens']} | {r['distance']} | {r['us']:.1f} | {r['speedup']:.3f}x | "
              f"{', '.join(f'{v:.1f}' for v in r['rounds'])} | {'yes' if r['same_bits'] else 'NO'} |" for r in rows]
    with open(os.path.join(args.out, f"ab_mma_l2_prefetch{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
