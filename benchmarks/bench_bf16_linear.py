"""The float32 linears of bf16 weights (DeepSeek-V4's compressor projections): ``bf16_linear_fp32`` (cuBLAS's bf16
GEMM with float32 output) against the float32 path the attention layer ran before (float32 weight copies,
``x.float() @ W.T``: cuBLAS SGEMM / GEMV) and the tensor-core tile kernel of ``router_logits.py`` (the op's fallback).

Per (N, K) and M: us per call in CUDA-graph replay (32 calls per graph cycling over >= 96 MB of weight copies, so
the L2 does not hold them; do_bench median / 32), the bf16 weight floor (bytes / 3.0 TB/s) and the worst error of
each path in units of 2**-24 * sum |x||w| against the exact sum (at the first M of the list and at 512).
A split-K Triton kernel was measured here too (gpu_check_v30 call b, commit 596ae0e) and dropped: cuBLAS was faster.

Usage: python benchmarks/bench_bf16_linear.py [--rows 1,2,4,8,16,32,64,128,512,4096] [--flush read]
       [--out PATH.md]   (CUDA only; ~1 min)
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

from megamoe.kernels.router_logits import launch_router_logits  # noqa: E402
from megamoe.ops import gemm as gemm_ops  # noqa: E402

SHAPES = [(2560, 4096, "V4-Flash CSA"), (1024, 4096, "V4-Flash HCA"), (2560, 7168, "V4-Pro CSA"),
          (1024, 7168, "V4-Pro HCA")]
GRAPH_CALLS = 32
GRAPH_BYTES = 96 << 20
HBM = 3.0e12


def per_call_us(make_call, copies: int, rep_ms: int) -> float:
    calls = [make_call(i % copies) for i in range(GRAPH_CALLS)]
    for c in calls[:copies]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return triton.testing.do_bench(g.replay, rep=rep_ms, return_mode="median") * 1e3 / GRAPH_CALLS


def err_units(y, x, w) -> float:
    exact = x.double() @ w.double().t()
    mag = (x.double().abs() @ w.double().abs().t()).clamp_min(1e-300)
    return float(((y.double() - exact).abs() / mag).max()) / 2.0 ** -24


def main():
    from graph_timing import add_flush_argument, use_flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,4096")
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--out", default=None)
    add_flush_argument(ap)
    args = ap.parse_args()
    use_flush_mode(args.flush)
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    try:
        torch.mm(torch.ones(1, 16, device=dev, dtype=torch.bfloat16),
                 torch.ones(16, 16, device=dev, dtype=torch.bfloat16), out_dtype=torch.float32,
                 out=torch.empty(1, 16, device=dev))
        have_mm_dtype = True
    except Exception:  # noqa: BLE001  (older torch: no out_dtype)
        have_mm_dtype = False
    lines = ["# float32 linears of bf16 weights (the V4 compressor projections)\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush: {args.flush}",
             f"- command: `python benchmarks/bench_bf16_linear.py --rows {args.rows} --flush {args.flush}`",
             "- us per call, CUDA-graph replay (32 calls per graph over >= 96 MB of weight copies, do_bench median / 32)."
             " fp32 = the layer before (float32 weights, `x.float() @ W.T`); cuBLAS bf16 = `torch.mm(x, W.T, "
             "out_dtype=float32)`; tile = `router_logits.py`'s kernel; op = `bf16_linear_fp32`; floor = (2NK + 2MK + "
             "4MN) bytes / 3.0 TB/s. err = worst |y - exact| / (2**-24 sum |x||w|).\n",
             "| shape | N x K | M | fp32 us | cuBLAS bf16 us | tile us | op us | floor us | op % floor | "
             "op / fp32 | err fp32 / tile / op (u) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, k, label in SHAPES:
        w_copies16 = [(torch.randn(n, k, device=dev) * k ** -0.5).bfloat16()
                      for _ in range(max(1, min(GRAPH_CALLS, -(-GRAPH_BYTES // (2 * n * k)))))]
        w_copies32 = [w.float() for w in w_copies16[:max(1, min(GRAPH_CALLS, -(-GRAPH_BYTES // (4 * n * k))))]]
        for m in rows:
            x = torch.randn(m, k, device=dev).bfloat16()
            out = torch.empty(m, n, device=dev)
            t = {}
            t["fp32"] = per_call_us(lambda i: (lambda: torch.matmul(x.float(), w_copies32[i].t(), out=out)),
                                    len(w_copies32), args.rep_ms)
            if have_mm_dtype:
                t["cublas"] = per_call_us(
                    lambda i: (lambda: torch.mm(x, w_copies16[i].t(), out_dtype=torch.float32, out=out)),
                    len(w_copies16), args.rep_ms)
            t["tile"] = per_call_us(lambda i: (lambda: launch_router_logits(x, w_copies16[i], out)),
                                    len(w_copies16), args.rep_ms)
            t["op"] = per_call_us(lambda i: (lambda: gemm_ops.bf16_linear_fp32(x, w_copies16[i], out=out)),
                                  len(w_copies16), args.rep_ms)
            floor = (2 * n * k + 2 * m * k + 4 * m * n) / HBM * 1e6
            errs = "-"
            if m in (rows[0], 512):
                w = w_copies16[0]
                e = [err_units(x.float() @ w.float().t(), x, w)]
                e.append(err_units(launch_router_logits(x, w), x, w))
                e.append(err_units(gemm_ops.bf16_linear_fp32(x, w), x, w))
                errs = " / ".join(f"{v:.1f}" for v in e)
            f = lambda key: f"{t[key]:.1f}" if key in t else "-"  # noqa: E731
            lines.append(f"| {label} | {n}x{k} | {m} | {f('fp32')} | {f('cublas')} | {f('tile')} | "
                         f"{f('op')} | {floor:.1f} | {100 * floor / t['op']:.0f}% | {t['fp32'] / t['op']:.2f}x | "
                         f"{errs} |")
            print(lines[-1], flush=True)
        w_copies16 = w_copies32 = None  # free this shape's copies before the next
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
