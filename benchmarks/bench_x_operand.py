"""Time the x-operand staging variants of the Gluon GEMMs against today's (issues 10 and 11; NOTES_gemm.md v16).

V4-Flash experts (E = 256, H = 4096, I = 2048, top-6), random NVFP4 codes made on the GPU, dispatch precomputed
(bench_mma_ring.py's helpers). Per (tokens, routing): gate_up (row gather + SwiGLU) then down through
``megamoe.ops.gemm.nvfp4_grouped_mm`` (the banded route), per variant: today; "x ring" (the wgmma band with
``nvfp4_wgmma.WGMMA_X_RING = 4``); "x smem" (the mma.sync BLOCK_M 32 band with
``nvfp4_mma_decode.MMA_X_SMEM_BLOCK_M = {32}``); both. CUDA graphs timed with ``triton.testing.do_bench``
medians (L2 cleared before each replay) as bench_peer.py. Every variant must give today's bits (same MMAs, same
K order); the column is checked. Reported: us per GEMM, TFLOP/s of the pair, and the x pre-pass alone
(``to_mma_k_order`` of the GEMM's input, inside each variant's time, once per band that uses it).

Usage: python benchmarks/bench_x_operand.py [--tokens 512,1024,4096,8192] [--routings uniform,zipf] [--rep-ms 30]
       [--out-dir DIR (default $OUT or benchmarks/results)] [--tag x_operand_v1]
Device time: ~2-3 min.
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
    p.add_argument("--tokens", default="512,1024,4096,8192")
    p.add_argument("--routings", default="uniform,zipf")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(_HERE, "results"))
    p.add_argument("--tag", default="x_operand_v1")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_x_operand: needs a CUDA GPU")
        return []
    import triton.testing

    from bench_mma_ring import E, H, I, TOP_K, codes_weight, dispatch
    from bench_moe_skew import routing
    from bench_peer import _graph
    from megamoe.format.mma_order import to_mma_k_order
    from megamoe.kernels.gemm import nvfp4_mma_decode, nvfp4_wgmma
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
            variants = {"today": (0, frozenset()), "x ring": (4, frozenset()), "x smem": (0, frozenset({32})),
                        "both": (4, frozenset({32}))}
            ref, res = {}, {}
            for name, (ring, smem) in variants.items():
                nvfp4_wgmma.WGMMA_X_RING, nvfp4_mma_decode.MMA_X_SMEM_BLOCK_M = ring, smem
                for gemm, fn, xin in (("gate_up", gate_up, x), ("down", down, inter)):
                    g, out = _graph(fn, xin)
                    g.replay()
                    torch.cuda.synchronize()
                    if name == "today":
                        ref[gemm] = out.clone()
                    same = bool(torch.equal(out, ref[gemm]))
                    us = triton.testing.do_bench(g.replay, warmup=5, rep=a.rep_ms, return_mode="median") * 1e3
                    res[(name, gemm)] = (us, same)
                    del g
            nvfp4_wgmma.WGMMA_X_RING, nvfp4_mma_decode.MMA_X_SMEM_BLOCK_M = 0, frozenset()
            for name in variants:
                gu, dn = res[(name, "gate_up")], res[(name, "down")]
                total = gu[0] + dn[0]
                row = dict(routing=kind, tokens=t, variant=name, max_rows=int(counts.max()), gate_up_us=gu[0],
                           down_us=dn[0], total_us=total, tflops=flops / total / 1e6,
                           same_bits=[gu[1], dn[1]], prepass_us=[prepass["gate_up"], prepass["down"]])
                rows.append(row)
                line = (f"| {kind} | {t} | {name} | {row['max_rows']} | {gu[0]:.1f} | "
                        f"{dn[0]:.1f} | {total:.1f} | {row['tflops']:.0f} | {gu[1] and dn[1]} | "
                        f"{prepass['gate_up']:.1f} / {prepass['down']:.1f} |")
                print(line, flush=True)
                lines.append(line)
    os.makedirs(a.out_dir, exist_ok=True)
    head = ["# x-operand staging vs today (V4-Flash gate_up+SwiGLU, down; banded route; graph replay, L2 cleared)",
            "", f"{torch.cuda.get_device_name()}, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, torch "
            f"{torch.__version__}, command: python benchmarks/bench_x_operand.py {' '.join(argv or sys.argv[1:])}",
            "", "| routing | tokens | variant | max rows | gate_up us | down us | total us | TFLOP/s | same bits | "
            "pre-pass us (gate_up / down) |", "|---|---|---|---|---|---|---|---|---|---|"]
    with open(os.path.join(a.out_dir, f"{a.tag}.md"), "w") as f:
        f.write("\n".join(head + lines) + "\n")
    with open(os.path.join(a.out_dir, f"{a.tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
