"""Dense NVFP4 linear at decode sizes with and without PDL on the split-K kernel (issue 11's dense rows).

Each point is timed as ``bench_gemm.py``'s graph timing: GRAPH_CALLS calls of ``nvfp4_linear`` per CUDA graph,
cycling weight copies of >= 96 MB, the L2 flushed before each replay, us per call (do_bench median / calls). The
settings, captured one after the other in the same process:

* ``plain``: no PDL on the split-K kernel (today's default);
* ``pdl``: each launch with PDL (``PDL_LAUNCH`` += "splitk"): it may start while the previous call runs, and waits
  for it before any global access;
* ``pdl+early``: the same, and the caller's ``weight_settled=True`` (what ``DenseLinear`` passes): a one-pass launch
  loads its first weight step before its wait (``PDL_EARLY_READS`` += "splitk").

The calls of one graph are independent (same x, one out), as a model's projections are not: there each call's x is
the previous kernel's output and only the weight reads may start early, which is what ``pdl+early`` does. bf16
``F.linear`` on the dequantized weights and the HBM floor (weights + activations / 3.0 TB/s) are in the same table.
Every setting's result is checked equal, bit for bit, to ``plain``'s first.

Run: ``python benchmarks/bench_dense_pdl.py [--rows 1,8,64] [--shapes 4096x4096,...] [--tag T] --out DIR``
-> DIR/bench_dense_pdl[_T].{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gemm import (GRAPH_BYTES, GRAPH_CALLS, _graph_time, dense_floor_us, dense_sweep_table,  # noqa: E402
                        dense_weight_copies, sweep_meta)

ISSUE_SHAPES = "18432x7168,32768x1024,4096x8192,4096x4096,1024x4096"
SETTINGS = {  # name: (PDL_LAUNCH additions, PDL_EARLY_READS additions, weight_settled)
    "plain": (set(), set(), False),
    "pdl": ({"splitk"}, set(), True),
    "pdl+early": ({"splitk"}, {"splitk"}, True),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rep-ms", type=int, default=20)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma list of M")
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="comma list of NxK")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    from megamoe.kernels import pdl
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    t0 = time.time()
    base_launch = pdl.PDL_LAUNCH - {"splitk"}
    base_early = pdl.PDL_EARLY_READS - {"splitk"}
    rows = []
    for n, k in [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]:
        ws, w_bf16 = dense_weight_copies(n, k, device)
        for m in [int(v) for v in args.rows.split(",")]:
            x = torch.randn(m, k, device=device).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            route = ops_gemm.decode_route(x, ws[0].data, m, None, n, k)
            row = dict(n=n, k=k, m=m, floor_us=dense_floor_us(n, m, k), route=route, times={})
            reference = None
            for name, (launch, early, settled) in SETTINGS.items():
                pdl.PDL_LAUNCH, pdl.PDL_EARLY_READS = base_launch | launch, base_early | early

                def make_call(i, settled=settled):
                    w = ws[i]
                    return lambda: ops_gemm.nvfp4_linear(x, w, out=out, weight_settled=settled)

                got = make_call(0)().clone()
                if reference is None:
                    reference = got
                if not torch.equal(got, reference):
                    row["times"][name] = "differs from plain"
                    continue
                row["times"][name] = _graph_time(make_call, len(ws), args.rep_ms)
            pdl.PDL_LAUNCH, pdl.PDL_EARLY_READS = base_launch, base_early
            row["times"]["bf16"] = _graph_time(lambda i: (lambda w=w_bf16[i]: torch.nn.functional.linear(x, w)),
                                               len(w_bf16), args.rep_ms)
            rows.append(row)
            t = row["times"]
            print(f"{n}x{k} M={m:3d} {route:8s} floor {row['floor_us']:6.1f}  "
                  + "  ".join(f"{name} {v:7.1f}" if isinstance(v, float) else f"{name} {v}" for name, v in t.items()),
                  flush=True)
    meta = sweep_meta(t0)
    suffix = f"_{args.tag}" if args.tag else ""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_dense_pdl{suffix}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Dense NVFP4 linear with PDL on the split-K kernel ({meta['date']}, {meta['device']}, torch "
             f"{meta['torch']}, triton {meta['triton']})", "",
             f"Command: `{meta['command']}` (wall {meta['wall_s']} s). Graph replay, {GRAPH_CALLS} calls per graph "
             f"cycling >= {GRAPH_BYTES >> 20} MB of weight copies, L2 flushed per replay, us per call (% of the HBM "
             "floor at 3.0 TB/s). Settings: module docstring of `benchmarks/bench_dense_pdl.py`. Routes: "
             + ", ".join(sorted({r['route'] for r in rows})) + ".", ""]
    lines += dense_sweep_table(rows)
    with open(os.path.join(args.out, f"bench_dense_pdl{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
