"""Issue 11: the fixed cost of one decode GEMM launch at 1 token, from a K sweep.

The 1-token gate_up GEMM of V4-Flash (7 touched groups of 257, one row each, SwiGLU, row-interleaved weights) is
timed at K = 1024 ... 8192 with everything else fixed (the same band, config, grid and tile table); a line
``time = a + b * K`` through the points splits the replay into a part that does not depend on K (graph launch, the
programs' tile table, the first load's latency, the epilogue, the tail) and a streaming rate (bytes / b).

Run (H100): ``python benchmarks/probe_decode_intercept.py [--ks 1024,2048,4096,8192] [--n 4096] [--flush read]
[--out FILE]``
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main(argv=None) -> int:
    from graph_timing import add_flush_argument, flush_mode, graph_replay_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="1024,2048,4096,8192")
    ap.add_argument("--n", type=int, default=4096, help="gate_up rows (2 x I)")
    ap.add_argument("--groups", type=int, default=257)
    ap.add_argument("--touched", type=int, default=7)
    add_flush_argument(ap, default="read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_intercept.py needs a CUDA GPU")
        return 0
    from gemm_helpers import random_codes_weight

    from megamoe.ops import gemm as gemm_ops

    dev = torch.device("cuda")
    touched = torch.randperm(args.groups)[:args.touched]
    counts = torch.zeros(args.groups, dtype=torch.int64)
    counts[touched] = 1
    offsets = counts.cumsum(0).to(torch.int32).to(dev)
    row_index = torch.zeros(args.touched, dtype=torch.int32, device=dev)
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        w = random_codes_weight((args.groups, args.n, k), dev, scale_shape=(args.groups, 1, 1)).interleave_rows(4)
        x = torch.randn(1, k, device=dev).bfloat16()
        out = torch.empty(args.touched, args.n // 2, dtype=torch.bfloat16, device=dev)

        def call(w=w, x=x, out=out):
            gemm_ops.nvfp4_grouped_mm(x, w, offsets, out=out, row_index=row_index, activation="swiglu",
                                      swiglu_limit=10.0, max_rows_per_expert=1)

        with flush_mode(args.flush):
            us = sorted(graph_replay_us(call, warmup=20, rep=200) for _ in range(3))[1]
        mb = args.touched * args.n * k * (0.5 + 1 / 16) / 1e6
        rows.append((k, us, mb))
        print(f"K={k}: {us:.2f} us, {mb:.1f} MB, {mb / us:.2f} TB/s", flush=True)
        del w
        torch.cuda.empty_cache()
    ks = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    ts = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    b = ((ks - ks.mean()) * (ts - ts.mean())).sum() / ((ks - ks.mean()) ** 2).sum()
    a = ts.mean() - b * ks.mean()
    rate = args.touched * args.n * (0.5 + 1 / 16) / 1e6 / b.item()  # MB per us = TB/s
    fit = f"time = {a.item():.2f} us + K x {b.item() * 1e3:.3f} ns: fixed part {a.item():.2f} us, streaming {rate:.2f} TB/s"
    print(fit)
    if args.out:
        lines = [f"# Decode GEMM fixed cost from a K sweep ({torch.cuda.get_device_name()})", "",
                 f"- {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; torch "
                 f"{torch.__version__}; triton {triton.__version__}", f"- command: `python {' '.join(sys.argv)}`",
                 f"- gate_up SwiGLU, N = {args.n}, {args.touched} of {args.groups} groups with one row (the same "
                 f"token), interleaved weights; graph replay, do_bench median ({args.flush} flush), middle of 3", "",
                 "| K | us | MB | TB/s |", "|---|---|---|---|"]
        lines += [f"| {k} | {us:.2f} | {mb:.1f} | {mb / us:.2f} |" for k, us, mb in rows]
        lines += ["", fit]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
