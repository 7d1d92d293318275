"""Dense NVFP4 linear at M = 1-4 (issue 11): the split-K kernel's mma.sync kind against its FMA kind.

At M = 1 the op's split-K route runs the CUDA-core FMA step (5.3 instructions per weight); its mma.sync kind (3.1 per
weight, 7 of 8 MMA rows idle at M = 1) was measured only from M = 8. This times both kinds at M = 1 under several tile
configs and programs per SM (the split count follows: ``plan_splitk``), next to the op and bf16 ``F.linear``, as
``bench_gemm.py``'s graph timing (GRAPH_CALLS calls per graph cycling >= 96 MB of weight copies, L2 flushed before
each replay, us per call). Each config's output is checked against the op's (relative error < 1e-2) first.

Run: ``python benchmarks/sweep_dense_m1.py [--rows 1,2,4] [--configs 0,2] [--tag T] --out DIR`` ->
DIR/sweep_dense_m1[_T].{md,json}.
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

from bench_gemm import (GRAPH_CALLS, dense_sweep_case, dense_sweep_table, dense_weight_copies,  # noqa: E402
                        sweep_meta, timed_checked)

SHAPES = [(18432, 7168), (32768, 1024), (4096, 8192), (4096, 4096), (1024, 4096)]  # (N, K)
# (kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs_per_sm, maxnreg)
CONFIGS = [
    ("fma", 1, 64, 256, 4, 4, 128),
    ("fma", 1, 64, 256, 4, 8, 128),
    ("mma", 8, 128, 256, 4, 3, None),
    ("mma", 8, 64, 256, 4, 4, 128),
    ("mma", 8, 128, 256, 8, 2, 128),
    ("mma", 8, 64, 256, 4, 6, 80),
    ("mma", 8, 128, 128, 4, 3, None),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rep-ms", type=int, default=20)
    parser.add_argument("--rows", default="1", help="comma list of M")
    parser.add_argument("--tag", default="")
    parser.add_argument("--splits", default="", help="comma list of forced split counts timed per config besides "
                        "the planned one")
    parser.add_argument("--configs", default=None, help="indices into CONFIGS (comma list; default all)")
    args = parser.parse_args()
    from megamoe.kernels.gemm import nvfp4_splitk as sk
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    t0 = time.time()
    configs = CONFIGS if args.configs is None else [CONFIGS[int(i)] for i in args.configs.split(",")]
    rows = []
    for (n, k), m in [(shape, int(m)) for shape in SHAPES for m in args.rows.split(",")]:
        ws, w_bf16 = dense_weight_copies(n, k, device)
        copies, bf16_copies = len(ws), len(w_bf16)
        x, out, ref, row = dense_sweep_case(ws, n, k, m, device)

        def timed(name, make, check=True):
            timed_checked(row["times"], name, make, copies, args.rep_ms, ref if check else None)

        timed("op", lambda i: (lambda w=ws[i]: ops_gemm.nvfp4_linear(x, w, out=out)))
        timed("bf16", lambda i: (lambda w=w_bf16[i % bf16_copies]: torch.nn.functional.linear(x, w)), check=False)
        timed("split-K default", lambda i: (lambda w=ws[i]: sk.launch_nvfp4_splitk(
            x, w.data, w.block_scale, w.global_scale, out)))
        for cfg in configs:
            timed(str(cfg), lambda i, c=cfg: (lambda w=ws[i]: sk.launch_nvfp4_splitk(
                x, w.data, w.block_scale, w.global_scale, out, config=c)))
            for forced in [int(v) for v in args.splits.split(",") if v.strip()]:
                timed(f"{cfg} S={forced}", lambda i, c=cfg, f=forced: (lambda w=ws[i]: sk.launch_nvfp4_splitk(
                    x, w.data, w.block_scale, w.global_scale, out, config=c, splits=f)))
        rows.append(row)
        print(f"N={n} K={k} M={m} floor {row['floor_us']:.1f} us: " + ", ".join(
            f"{key} {v:.1f}" if isinstance(v, float) else f"{key} {v}" for key, v in row["times"].items()),
            flush=True)
        ws = w_bf16 = None
        torch.cuda.empty_cache()
    meta = sweep_meta(t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sweep_dense_m1{'_' + args.tag if args.tag else ''}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Dense NVFP4 linear, M = {args.rows}: split-K kinds and configs ({meta['date']}, {meta['device']}, "
             f"torch {meta['torch']}, triton {meta['triton']})", "", f"Command: `{meta['command']}` "
             f"(wall {meta['wall_s']} s). Graph replay, {GRAPH_CALLS} calls per graph, L2 flushed per replay, "
             "us per call (% of the HBM floor at 3.0 TB/s). Configs: (kind, BLOCK_M, BLOCK_N, BLOCK_K, warps, "
             "programs per SM, register cap).", "", *dense_sweep_table(rows)]
    with open(os.path.join(args.out, f"sweep_dense_m1{'_' + args.tag if args.tag else ''}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
