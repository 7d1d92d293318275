"""Hyper-connection decode latency (issues 9 / 11): one decoder layer's hc chain, CUDA-graph replay, medians.

Paths per (dims, batch):
* ``unfused``: hc_pre(attn) -> hc_post -> hc_pre(ffn) -> hc_post (6 launches; the chain before the fusion),
* ``fused``: hc_post_pre(attn -> ffn) -> hc_post_pre(ffn -> next layer's attn) (4 launches; the model's chain),
and the single ops (hc_pre, hc_post, hc_post_pre). Each graph holds REPS copies of the chain; the time is the
median over replays divided by REPS (GPU time incl. the launch gaps of a graph replay).

    python benchmarks/bench_hyper_connection.py [--batch 1,8,64] [--dims flash,pro] [--reps 20] [--iters 50]
        [--finish-variants v2,v3,v3h,v2rcp]

``--finish-variants``: a second table timing hc_pre and the fused layer per finish-kernel variant
(:data:`FINISH_VARIANTS`: positions per thread, reciprocal Sinkhorn, hoist bound of
``megamoe.kernels.hyper_connection``), with each variant's largest |difference| of post / comb from v2's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from megamoe.ops import hyper_connection as hc_ops  # noqa: E402

DIMS = {"flash": 4096, "pro": 7168}
#: name -> (FINISH_POSITIONS_PER_THREAD, FINISH_RCP, FINISH_HOIST_MAX): v2 = the kernel before 2026-11-25 part 7
#: (8 warps at 4096, divisions, x hoisted), v3 = today's default.
FINISH_VARIANTS = {"v2": (16, False, 16), "v2rcp": (16, True, 16), "v3": (32, True, 16), "v3h": (32, True, 32)}
HC, ITERS, EPS = 4, 20, 1e-6


def inputs(T, D, dev):
    M = (2 + HC) * HC
    g = torch.Generator(device=dev).manual_seed(T * 7 + D)

    def r(*s):
        return torch.randn(*s, device=dev, generator=g)

    params = [dict(hc_fn=r(M, HC * D) * 1e-2, hc_scale=torch.ones(3, device=dev), hc_base=r(M) * 0.5,
                   iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=torch.rand(D, device=dev, generator=g) + 0.5)
              for _ in range(2)]
    return r(T, HC, D).to(torch.bfloat16), r(T, D).to(torch.bfloat16), params


def pre(h, p):
    return hc_ops.hc_pre(h, p["hc_fn"], p["hc_scale"], p["hc_base"], hc=HC, iters=p["iters"], hc_eps=p["hc_eps"],
                         norm_eps=p["norm_eps"], norm_weight=p["norm_weight"])


def time_graph(fn, reps, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--dims", default="flash,pro")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--finish-variants", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | graph of {args.reps} chains, median of "
          f"{args.iters} replays, us per chain / op")
    print("| dims | batch | unfused layer (6 launches) | fused layer (4 launches) | hc_pre | hc_post | hc_post_pre |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dims.split(","):
        D = DIMS[name]
        for T in (int(b) for b in args.batch.split(",")):
            h, y, (pa, pf) = inputs(T, D, dev)
            x0, post0, comb0 = pre(h, pa)

            def unfused():
                x, post, comb = pre(h, pa)
                h1 = hc_ops.hc_post(y, h, post, comb)
                x, post, comb = pre(h1, pf)
                return hc_ops.hc_post(y, h1, post, comb)

            def fused():
                h1, x, post, comb = hc_ops.hc_post_pre(y, h, post0, comb0, **pf)
                return hc_ops.hc_post_pre(y, h1, post, comb, **pa)

            row = [time_graph(unfused, args.reps, args.iters), time_graph(fused, args.reps, args.iters),
                   time_graph(lambda: pre(h, pa), args.reps, args.iters),
                   time_graph(lambda: hc_ops.hc_post(y, h, post0, comb0), args.reps, args.iters),
                   time_graph(lambda: hc_ops.hc_post_pre(y, h, post0, comb0, **pf), args.reps, args.iters)]
            print(f"| {name} ({D}) | {T} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    if args.finish_variants:
        finish_variants(args, dev)


def finish_variants(args, dev):
    from megamoe.kernels import hyper_connection as hk

    saved = (hk.FINISH_POSITIONS_PER_THREAD, hk.FINISH_RCP, hk.FINISH_HOIST_MAX)
    names = args.finish_variants.split(",")
    print("\n| dims | batch | variant | warps | hoist | hc_pre us | fused layer us | max abs diff post / comb vs v2 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.dims.split(","):
        D = DIMS[name]
        for T in (int(b) for b in args.batch.split(",")):
            h, y, (pa, pf) = inputs(T, D, dev)
            base = None
            for v in ["v2"] + [n for n in names if n != "v2"]:
                hk.FINISH_POSITIONS_PER_THREAD, hk.FINISH_RCP, hk.FINISH_HOIST_MAX = FINISH_VARIANTS[v]
                x0, post0, comb0 = pre(h, pa)
                if base is None:
                    base = (post0.clone(), comb0.clone())
                diff = f"{(post0 - base[0]).abs().max().item():.1e} / {(comb0 - base[1]).abs().max().item():.1e}"

                def fused():
                    h1, x, post, comb = hc_ops.hc_post_pre(y, h, post0, comb0, **pf)
                    return hc_ops.hc_post_pre(y, h1, post, comb, **pa)

                t_pre = time_graph(lambda: pre(h, pa), args.reps, args.iters)
                t_layer = time_graph(fused, args.reps, args.iters)
                if v in names:
                    print(f"| {name} ({D}) | {T} | {v} | {hk.finish_warps(D)} | {hk.finish_hoist(D)} | {t_pre:.1f} | "
                          f"{t_layer:.1f} | {diff} |")
    hk.FINISH_POSITIONS_PER_THREAD, hk.FINISH_RCP, hk.FINISH_HOIST_MAX = saved


if __name__ == "__main__":
    main()
