"""Sweep of the fused route + dispatch launch's GEMV plan at decode sizes (issue 11): experts per program
(``BLOCK_E``, the whole H per program) and warps, against today's plan (``plan_route_dispatch``), same run.

Each plan is timed as a CUDA-graph replay of ``megamoe.ops.moe.route_dispatch`` (do_bench median, L2 cleared
before each replay by ``--flush``), and its outputs (ids, weights, offsets, row index) are compared with today's:
the per-expert fp32 sums may reduce in another order, so ids can differ only where selection scores tie to within
that; the table says whether everything was equal.

Run (H100): ``python benchmarks/sweep_route_plan.py [--tokens 1,2,4] [--flush read] [--out FILE.md]``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"v4-flash": (256, 4096), "v4-pro": (384, 7168)}
PLANS = [(1, 4), (1, 2), (2, 8), (2, 4), (4, 8), (8, 8)]  # (BLOCK_E, num_warps); None = today's


def _plan(base, block_e, num_warps, num_experts, hidden):
    """Today's plan dict with BLOCK_E experts x the whole H per program and ``num_warps`` warps (no H split)."""
    import triton

    p = dict(base)
    h_pad = triton.next_power_of_2(max(hidden, 16))
    threads = 32 * num_warps
    p.update(BLOCK_E=block_e, CHUNK=h_pad, num_warps=num_warps, e_blocks=triton.cdiv(num_experts, block_e), splits=1,
             SPLITS_PAD=1, TB=max(1, min(p["T_PAD"], 64 * threads // (h_pad * block_e) or 1)),
             BT=max(1, min(p["T_PAD"], 8 * threads // triton.next_power_of_2(num_experts))))
    return p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--flush", default="read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_route_plan.py needs a CUDA GPU")
        return 0
    import triton.testing
    from graph_timing import flush_mode
    from megamoe.kernels import moe_route_dispatch as rd
    from megamoe.layers.moe import dispatch_buffers
    from megamoe.ops import moe as moe_ops

    original = rd.plan_route_dispatch
    k = 6
    lines = [f"# Fused route + dispatch GEMV plans ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__})", "",
             f"Command: `python {' '.join(sys.argv)}`; L2 cleared by a {args.flush} flush before each replay", "",
             "| shape | tokens | plan (BLOCK_E, warps) | programs | us | vs today | same outputs |",
             "|---|---|---|---|---|---|---|"]
    with flush_mode(args.flush):
        for name, (e, h) in SHAPES.items():
            gate = (torch.randn(e, h, device="cuda") * h ** -0.5).bfloat16()
            bias = torch.rand(e, device="cuda") * 0.1
            for t in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(t, h, device="cuda").bfloat16()
                results = {}
                for plan in [None] + PLANS:
                    wb = torch.ones(t, k + 1, device="cuda")
                    ib = torch.full((t, k + 1), e, dtype=torch.int32, device="cuda")
                    bufs = dispatch_buffers(t * (k + 1), e + 1, "cuda")
                    kw = dict(top_k=k, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_groups=e + 1,
                              slots=k + 1, out=(wb, ib), buffers=bufs)
                    if plan is not None:
                        rd.plan_route_dispatch = lambda *a, plan=plan: _plan(original(*a), *plan, e, h)
                    try:
                        fn = lambda: moe_ops.route_dispatch(x, gate, bias, **kw)  # noqa: E731
                        fn()
                        torch.cuda.synchronize()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            fn()
                        g.replay()
                        torch.cuda.synchronize()
                    finally:
                        rd.plan_route_dispatch = original
                    us = triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3
                    outs = [wb.clone(), ib.clone()] + [bufs[key][:t * (k + 1)].clone() for key in
                                                       ("sorted_expert", "row_index", "inv_perm")]
                    outs.append(bufs["expert_offsets"].clone())
                    results[plan] = (us, outs)
                    base_us, base_outs = results[None]
                    same = all(torch.equal(a, b) for a, b in zip(outs, base_outs))
                    progs = (rd.plan_route_dispatch(t, e, h, 132)["e_blocks"] if plan is None
                             else -(-e // plan[0]))
                    label = "today" if plan is None else str(plan)
                    lines.append(f"| {name} | {t} | {label} | {progs} | {us:.2f} | {base_us / us:.3f}x | {same} |")
                    print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
