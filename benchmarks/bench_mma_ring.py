"""Time the cp.async weight ring of the mma.sync decode kernel against today's route (peer study, issue 10).

V4-Flash experts (E = 256, H = 4096, I = 2048, top-6), random NVFP4 codes made on the GPU, dispatch precomputed.
Per (tokens, routing): gate_up (row gather + SwiGLU) then down through ``megamoe.ops.gemm.nvfp4_grouped_mm``
(the banded route: the (8, 64]-row band runs the mma.sync kernel's BLOCK_M 32 config, the rest as today), once
with today's config and once per ring depth S (the same config with a 5th element S, patched into
``MMA_DECODE_CONFIGS`` at run time, i.e. what ``MEGAMOE_MMA_STAGES=S`` does at import). Every variant is a CUDA
graph timed with ``triton.testing.do_bench(graph.replay, return_mode="median")`` (L2 cleared before each replay),
the same method as bench_peer.py. Each ring variant's outputs must equal today's bit for bit (same K order, same
math); other BLOCK_K: a different fp32 summation order, so the relative difference is printed. ``--configs``:
further band configs (e.g. BLOCK_M 16 with a ring). Reported: us, the touched experts' NVFP4 bytes / time
(GB/s) and % of 3.0 TB/s.

Usage: python benchmarks/bench_mma_ring.py [--tokens 512,1024] [--routings uniform,zipf] [--stages 2,3,4,6]
       [--rep-ms 30] [--out-dir DIR (default $OUT or benchmarks/results)] [--tag mma_ring_v1]
Device time: ~2-3 min (weights ~10 s, ~14 compiles, 4 points x 7 variants x 2 GEMMs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

E, H, I, TOP_K = 256, 4096, 2048, 6
HBM = 3.0e12


def codes_weight(shape, gen):
    """Random FP4 codes and E4M3 block scales in [0.5, 448], global scale ~1e-3 per expert (on the GPU)."""
    from megamoe.format.tensor import NVFP4Tensor

    e, n, k = shape
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    code = torch.randint(0x30, 0x7F, (e, n, k // 16), dtype=torch.uint8, device="cuda", generator=gen)
    gs = (torch.rand((e, 1, 1), device="cuda", generator=gen) + 0.5) * 1e-3
    return NVFP4Tensor(data, code.view(torch.float8_e4m3fn), gs.float(), tuple(shape))


def dispatch(ids: torch.Tensor):
    """(row_index (T*k,) int32 source token of each expert-sorted row, offsets (E,) int32, counts (E,))."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    return (order // ids.shape[1]).to(torch.int32).cuda(), counts.cumsum(0).to(torch.int32).cuda(), counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,1024")
    p.add_argument("--routings", default="uniform,zipf")
    p.add_argument("--stages", default="2,3,4,6")
    p.add_argument("--configs", default="16x128x128x4x4,16x128x256x4x4",
                   help="further band configs BLOCK_MxBLOCK_NxBLOCK_Kxwarps[xstages] ('' for none)")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(_HERE, "results"))
    p.add_argument("--tag", default="mma_ring_v1")
    a = p.parse_args(argv)
    import triton.testing

    from bench_moe_skew import routing
    from bench_peer import _graph
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.ops.gemm import nvfp4_grouped_mm

    key = 1 << 62
    base = tuple(mma.MMA_DECODE_CONFIGS[key][:4])
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = codes_weight((E, 2 * I, H), gen), codes_weight((E, H, I), gen)
    variants = [("today", base)] + [(f"ring S={s}", base + (int(s),)) for s in a.stages.split(",") if s]
    variants += [(c, tuple(int(v) for v in c.split("x"))) for c in a.configs.split(",") if c]
    rows, lines = [], []
    for kind in a.routings.split(","):
        for t in [int(x) for x in a.tokens.split(",")]:
            _, ids = routing(kind, t, E, TOP_K, torch.Generator().manual_seed(t))
            row_index, offsets, counts = dispatch(ids)
            touched = int((counts > 0).sum())
            nbytes = touched * (2 * I * H + H * I) * (0.5 + 1 / 16)
            x = (torch.randn(t, H, device="cuda") * 0.05).bfloat16()
            n_rows = t * TOP_K

            def gate_up(xx):
                return nvfp4_grouped_mm(xx, w13, offsets, row_index=row_index, activation="swiglu",
                                        swiglu_limit=10.0, max_rows_per_expert=t)

            inter = (torch.randn(n_rows, I, device="cuda") * 0.05).bfloat16()

            def down(xx):
                return nvfp4_grouped_mm(xx, w2, offsets, max_rows_per_expert=t)

            ref = {}
            for name, cfg in variants:
                mma.MMA_DECODE_CONFIGS[key] = cfg
                res = {}
                for gemm, fn, xin in (("gate_up", gate_up, x), ("down", down, inter)):
                    g, out = _graph(fn, xin)
                    g.replay()
                    torch.cuda.synchronize()
                    same = None
                    if name == "today":
                        ref[gemm] = out.clone()
                    else:  # bit-equal when the K step (the MMA K order) is the same; else the relative difference
                        same = bool(torch.equal(out, ref[gemm])) or float(
                            (out.float() - ref[gemm].float()).norm() / ref[gemm].float().norm())
                    us = triton.testing.do_bench(g.replay, warmup=5, rep=a.rep_ms, return_mode="median") * 1e3
                    res[gemm] = dict(us=us, same_bits=same)
                    del g
                total = res["gate_up"]["us"] + res["down"]["us"]
                row = dict(routing=kind, tokens=t, variant=name, config=list(cfg), touched=touched,
                           max_rows=int(counts.max()), gate_up_us=res["gate_up"]["us"], down_us=res["down"]["us"],
                           total_us=total, gbps=nbytes / total / 1e3, pct_hbm=100 * nbytes / (total * 1e-6) / HBM,
                           same_bits=[res["gate_up"]["same_bits"], res["down"]["same_bits"]])
                rows.append(row)
                line = (f"| {kind} | {t} | {name} | {row['max_rows']} | {row['gate_up_us']:.1f} | {row['down_us']:.1f} "
                        f"| {total:.1f} | {row['gbps']:.0f} | {row['pct_hbm']:.0f}% | {row['same_bits']} |")
                print(line, flush=True)
                lines.append(line)
            mma.MMA_DECODE_CONFIGS[key] = base
    os.makedirs(a.out_dir, exist_ok=True)
    head = ["# mma.sync ring vs today's route (V4-Flash gate_up+SwiGLU, down; graph replay, L2 cleared)", "",
            f"{torch.cuda.get_device_name()}, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, "
            f"command: python benchmarks/bench_mma_ring.py {' '.join(argv or sys.argv[1:])}", "",
            "| routing | tokens | variant | max rows | gate_up us | down us | total us | GB/s | % of 3 TB/s | "
            "same bits or rel. diff (gate_up, down) |", "|---|---|---|---|---|---|---|---|---|---|"]
    with open(os.path.join(a.out_dir, f"{a.tag}.md"), "w") as f:
        f.write("\n".join(head + lines) + "\n")
    with open(os.path.join(a.out_dir, f"{a.tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
