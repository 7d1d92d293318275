"""Sweep of the grouped decode kernel's small-band tile config and split-K at 1 / 8 tokens (issue 11).

Nsight Compute on the H100 (2026-11-23 part 4, ``benchmarks/probe_decode_ncu.py``) found the 1-token V4-Flash
GEMMs issue-latency bound, not bandwidth bound: 168 registers allow 3 blocks of 4 warps per SM, the grid
holds 1.7 blocks per SM, 1.5 warps per scheduler, 0.43 instructions issued per cycle, DRAM at 40%. This times
configs with more warps per weight row group (8 warps x 16 rows), shorter K steps (fewer registers) and split-K
S = 1..4, in graph replay with L2 flushed (bench_decode_splitk's timing), output checked against the current
config (max |diff| / max |ref|).

Usage: python benchmarks/sweep_decode_config.py [--configs v4-flash,v4-pro] [--tokens 1,8] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

CONFIGS = [(8, 128, 256, 4), (8, 128, 128, 4), (8, 64, 256, 4), (8, 64, 128, 4), (8, 128, 256, 8),
           (8, 128, 128, 8), (8, 256, 256, 8)]
SPLITS = [1, 2, 3, 4]


def main():
    import torch
    import triton

    from bench_decode_splitk import HBM_BYTES_PER_S, SHAPES, TOP_K, _graph, _routing, _time
    from gemm_helpers import random_codes_weight
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.ops import gemm as ops_gemm

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--rep-ms", type=float, default=30.0)
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "decode_config_sweep"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    rows = []
    default = mma.MMA_DECODE_CONFIGS[4]
    for name in args.configs.split(","):
        h, i, e = SHAPES[name]
        w13 = random_codes_weight((e, 2 * i, h), dev, scale_shape=(e, 1, 1))
        w2 = random_codes_weight((e, h, i), dev, scale_shape=(e, 1, 1))
        gen = torch.Generator().manual_seed(0)
        for tokens in [int(v) for v in args.tokens.split(",")]:
            counts, row_index = _routing("random", e, tokens, gen)
            offsets = counts.cumsum(0).to(torch.int32).to(dev)
            row_index = row_index.to(dev)
            t = TOP_K * tokens
            x = torch.randn(tokens, h, device=dev).bfloat16()
            inter = torch.randn(t, i, device=dev).bfloat16()
            for proj, w, n, k in (("gate_up", w13, 2 * i, h), ("down", w2, h, i)):
                out = torch.empty(t, i if proj == "gate_up" else h, dtype=torch.bfloat16, device=dev)

                def fn(w=w, proj=proj, out=out):
                    if proj == "gate_up":
                        return ops_gemm.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, out=out,
                                                         activation="swiglu", swiglu_limit=10.0,
                                                         max_rows_per_expert=tokens)
                    return ops_gemm.nvfp4_grouped_mm(inter, w, offsets, out=out, max_rows_per_expert=tokens)

                floor = int((counts > 0).sum()) * n * k * 9 / 16 / HBM_BYTES_PER_S * 1e6
                ref = None
                for config in CONFIGS:
                    for splits in SPLITS:
                        if time.time() - t0 > args.budget:
                            break
                        mma.MMA_DECODE_CONFIGS[4] = config
                        ops_gemm.DECODE_SPLITK = splits
                        try:
                            g, o = _graph(fn)
                            us = _time(g, args.rep_ms)
                            o = o.float().clone()
                            del g
                            err = None
                        except Exception as exc:  # a config that does not build / launch: recorded, skipped
                            us, o, err = float("inf"), None, f"{type(exc).__name__}: {str(exc)[:120]}"
                        if ref is None and o is not None:
                            ref = o
                        diff = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if o is not None \
                            else None
                        rows.append(dict(config=name, proj=proj, tokens=tokens, tile=list(config), splits=splits,
                                         us=us, floor_us=floor, diff=diff, error=err))
                        print(f"{name} {proj} {tokens} tok {config} S={splits}: {us:.1f} us (floor {floor:.1f})"
                              f" diff {diff}" + (f" {err}" if err else ""), flush=True)
                mma.MMA_DECODE_CONFIGS[4] = default
                ops_gemm.DECODE_SPLITK = 1
        del w13, w2
        torch.cuda.empty_cache()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv), seconds=round(time.time() - t0))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Decode small-band config x split-K sweep\n\n- {json.dumps(meta)}\n- graph replay, L2 flushed, "
                "do_bench median us; diff = max |out - first config's| / max |first|\n\n"
                "| config | GEMM | tokens | tile (M, N, K, warps) | S | us | floor us | % floor | diff | error |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            pct = f"{100 * r['floor_us'] / r['us']:.0f}%" if r["us"] != float("inf") else "-"
            f.write(f"| {r['config']} | {r['proj']} | {r['tokens']} | {tuple(r['tile'])} | {r['splits']} | "
                    f"{r['us']:.1f} | {r['floor_us']:.1f} | {pct} | {r['diff']} | {r['error'] or ''} |\n")
    print("wrote", args.out + ".md")


if __name__ == "__main__":
    main()
