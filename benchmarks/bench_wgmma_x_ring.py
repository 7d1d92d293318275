"""Time the wgmma kernel's x ring (v16, ``MEGAMOE_WGMMA_X_RING``) against today's loop (issue 10).

V4-Flash experts (E = 256, H = 4096, I = 2048, top-6), random NVFP4 codes made on the GPU, dispatch precomputed
(bench_mma_ring.py's helpers). Per (tokens, routing): gate_up (row gather + SwiGLU) then down through
``megamoe.ops.gemm.nvfp4_grouped_mm`` (the banded route; its wgmma band is what the switch changes), once with
``nvfp4_wgmma.WGMMA_X_RING = 0`` (today) and once with 4. CUDA graphs timed with ``triton.testing.do_bench``
medians (L2 cleared before each replay) as bench_peer.py. The ring must give today's bits (same MMAs, same K
order); the column is checked. Reported: us per GEMM, TFLOP/s of the pair, and the x pre-pass alone
(``to_mma_k_order`` of the GEMM's input, included in the ring's time).

Usage: python benchmarks/bench_wgmma_x_ring.py [--tokens 1024,4096,8192] [--routings uniform,zipf] [--rep-ms 30]
       [--out-dir DIR (default $OUT or benchmarks/results)] [--tag wgmma_x_ring_v1]
Device time: ~1-2 min.
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,8192")
    p.add_argument("--routings", default="uniform,zipf")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(_HERE, "results"))
    p.add_argument("--tag", default="wgmma_x_ring_v1")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wgmma_x_ring: needs a CUDA GPU")
        return []
    import triton.testing

    from bench_mma_ring import E, H, I, TOP_K, codes_weight, dispatch
    from bench_moe_skew import routing
    from bench_peer import _graph
    from megamoe.format.mma_order import to_mma_k_order
    from megamoe.kernels.gemm import nvfp4_wgmma
    from megamoe.ops.gemm import nvfp4_grouped_mm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = codes_weight((E, 2 * I, H), gen), codes_weight((E, H, I), gen)
    rows, lines = [], []
    for kind in a.routings.split(","):
        for t in [int(x) for x in a.tokens.split(",")]:
            _, ids = routing(kind, t, E, TOP_K, torch.Generator().manual_seed(t))
            row_index, offsets, counts = dispatch(ids)
            x = (torch.randn(t, H, device="cuda") * 0.05).bfloat16()
            inter = (torch.randn(t * TOP_K, I, device="cuda") * 0.05).bfloat16()
            flops = 2.0 * t * TOP_K * (2 * I * H + H * I)

            def gate_up(xx):
                return nvfp4_grouped_mm(xx, w13, offsets, row_index=row_index, activation="swiglu",
                                        swiglu_limit=10.0, max_rows_per_expert=t)

            def down(xx):
                return nvfp4_grouped_mm(xx, w2, offsets, max_rows_per_expert=t)

            prepass = {}
            for gemm, xin in (("gate_up", x), ("down", inter)):
                g, _ = _graph(to_mma_k_order, xin)
                prepass[gemm] = triton.testing.do_bench(g.replay, warmup=5, rep=a.rep_ms, return_mode="median") * 1e3
            ref, res = {}, {}
            for ring in (0, 4):
                nvfp4_wgmma.WGMMA_X_RING = ring
                for gemm, fn, xin in (("gate_up", gate_up, x), ("down", down, inter)):
                    g, out = _graph(fn, xin)
                    g.replay()
                    torch.cuda.synchronize()
                    if ring == 0:
                        ref[gemm] = out.clone()
                    same = bool(torch.equal(out, ref[gemm]))
                    us = triton.testing.do_bench(g.replay, warmup=5, rep=a.rep_ms, return_mode="median") * 1e3
                    res[(ring, gemm)] = (us, same)
                    del g
            nvfp4_wgmma.WGMMA_X_RING = 0
            for ring in (0, 4):
                gu, dn = res[(ring, "gate_up")], res[(ring, "down")]
                total = gu[0] + dn[0]
                row = dict(routing=kind, tokens=t, x_ring=ring, max_rows=int(counts.max()), gate_up_us=gu[0],
                           down_us=dn[0], total_us=total, tflops=flops / total / 1e6,
                           same_bits=[gu[1], dn[1]], prepass_us=[prepass["gate_up"], prepass["down"]])
                rows.append(row)
                line = (f"| {kind} | {t} | {'x ring 4' if ring else 'today'} | {row['max_rows']} | {gu[0]:.1f} | "
                        f"{dn[0]:.1f} | {total:.1f} | {row['tflops']:.0f} | {gu[1] and dn[1]} | "
                        f"{prepass['gate_up']:.1f} / {prepass['down']:.1f} |")
                print(line, flush=True)
                lines.append(line)
    os.makedirs(a.out_dir, exist_ok=True)
    head = ["# wgmma x ring vs today's loop (V4-Flash gate_up+SwiGLU, down; banded route; graph replay, L2 cleared)",
            "", f"{torch.cuda.get_device_name()}, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, torch "
            f"{torch.__version__}, command: python benchmarks/bench_wgmma_x_ring.py {' '.join(argv or sys.argv[1:])}",
            "", "| routing | tokens | loop | max rows | gate_up us | down us | total us | TFLOP/s | same bits | "
            "pre-pass us (gate_up / down, inside the ring's time) |", "|---|---|---|---|---|---|---|---|---|---|"]
    with open(os.path.join(a.out_dir, f"{a.tag}.md"), "w") as f:
        f.write("\n".join(head + lines) + "\n")
    with open(os.path.join(a.out_dir, f"{a.tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
