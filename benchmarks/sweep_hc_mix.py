"""The hyper-connection mixes (``hc_pre``: the mixes-partial kernel + the finish kernel) with the float32 FMA ``tl.dot``
steps against the tensor-core steps (``hyper_connection.MIX_TC_*``: tokens per program, hidden positions per step,
warps), V4 dims, 16-4096 tokens. us per call in CUDA-graph replay (one call per graph, do_bench median, ``--flush``),
and the largest |post| / |comb| difference of each configuration from the FMA path's.

Usage: python benchmarks/sweep_hc_mix.py [--tokens 16,64,512,4096] [--flush read] [--out PATH.md]   (CUDA; ~1 min)
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import megamoe.kernels.hyper_connection as hcm  # noqa: E402

HC = 4
CONFIGS = [None, (64, 16, 8), (64, 16, 16), (32, 16, 8), (128, 16, 16)]  # None: the float32 FMA steps


def mix_error_units(x, fn, tc: bool) -> float:
    """Worst error of the mixes-partial kernel's dots (its S partials summed in float64) in units of 2**-24 *
    sum |x||fn|, with the FMA steps (tc False) or the tensor-core steps of the default config."""
    T, hc, D = x.shape
    M = fn.shape[0]
    MP = hcm.mix_mp(M)
    bt, dot, bdi, ch, S, warps = hcm.mix_plan(T, D, tc)
    ws = torch.empty((S, T, MP), dtype=torch.float32, device=x.device)
    x16 = x.view(torch.int16)
    hcm._hc_mix_partial_kernel[(triton.cdiv(T, bt), S)](
        x16, x16, fn, fn, x16, x16, fn, ws, T, D, 1.0, HC=hc, M=M, MP=MP, BT=bt, CH=ch, BDI=bdi, POST=False,
        DOT=dot, TC=tc, INTERPRET=False, num_warps=warps, **hcm._EXACT)
    got = ws.double().sum(0)[:, :M]
    xf = x.reshape(T, hc * D).double()
    exact = xf @ fn.double().t()
    mag = (xf.abs() @ fn.double().abs().t()).clamp_min(1e-300)
    return float(((got - exact).abs() / mag).max()) / 2.0 ** -24


def main():
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,512,4096")
    ap.add_argument("--dims", default="4096,7168")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs-default-only", action="store_true", help="time the FMA path and the default TC config")
    add_flush_argument(ap)
    args = ap.parse_args()
    use_flush_mode(args.flush)
    dev = torch.device("cuda")
    default = (hcm.MIX_TC_MIN_T, hcm.MIX_TC_BT, hcm.MIX_TC_BDI, hcm.MIX_TC_WARPS)
    configs = [None, default[1:]] if args.configs_default_only else CONFIGS
    names = ["fma" if c is None else "tc " + str(c) for c in configs]
    lines = ["# hc_pre mixes: float32 FMA steps vs tensor-core steps\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush {args.flush}; default TC config "
             f"(min T, BT, BDI, warps) {default}",
             f"- command: `python benchmarks/sweep_hc_mix.py --tokens {args.tokens} --dims {args.dims} --flush {args.flush}"
             f"{' --configs-default-only' if args.configs_default_only else ''}`",
             "- us per hc_pre call (partial + finish kernels, with the norm), graph replay; (d) = max |post, comb| "
             "difference from the fma path\n",
             "- err: the mixes' dot products (the partials summed in float64) against the exact float64 dots, worst "
             "|error| / (2**-24 sum |x||fn|), FMA steps / tensor-core steps (default config)\n",
             "| dim | T | " + " | ".join(names) + " | err fma / tc (u) |", "|---|---|" + "---|" * (len(names) + 1)]
    for D in (int(d) for d in args.dims.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            torch.manual_seed(T)
            M, K = (2 + HC) * HC, HC * D
            x = torch.randn(T, HC, D, device=dev).to(torch.bfloat16)
            fn = torch.randn(M, K, device=dev) * K ** -0.5 * 2
            scale, base = torch.rand(3, device=dev) + 0.5, torch.randn(M, device=dev)
            w = torch.rand(D, device=dev) + 0.5
            cells, ref = [], None
            for c in configs:
                if c is None:
                    hcm.MIX_TC_MIN_T = 1 << 30
                else:
                    hcm.MIX_TC_MIN_T = default[0]
                    hcm.MIX_TC_BT, hcm.MIX_TC_BDI, hcm.MIX_TC_WARPS = c

                def call():
                    return hcm.launch_hc_pre(x, fn, scale, base, w, iters=20, hc_eps=1e-6, norm_eps=1e-6,
                                             rms_eps=1e-6)
                outs = call()
                us = graph_replay_us(call, warmup=25, rep=30)
                if ref is None:
                    ref, cells = outs, [f"{us:.1f}"]
                else:
                    d = max(float((outs[2] - ref[2]).abs().max()), float((outs[3] - ref[3]).abs().max()))
                    cells.append(f"{us:.1f} ({d:.1e})")
            hcm.MIX_TC_MIN_T, hcm.MIX_TC_BT, hcm.MIX_TC_BDI, hcm.MIX_TC_WARPS = default
            errs = [mix_error_units(x, fn, tc) for tc in (False, True)]
            cells.append(f"{errs[0]:.1f} / {errs[1]:.1f}")
            lines.append(f"| {D} | {T} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
