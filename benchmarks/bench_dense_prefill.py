"""Dense NVFP4 linears at prefill sizes (the V4 attention projections): ``nvfp4_linear`` as routed without the host
scale (the kernels: split-K, Triton tensor-core, or from 512 rows the pipelined wgmma kernel as one expert), with it
(route "dense-bf16": the weight dequantized exactly to bf16, cuBLAS with the global scale as alpha), against bf16
``F.linear`` (cuBLAS) on an already dequantized weight (the bf16 model's GEMM: no dequantize in its time).

The fused projections are built as the attention block builds them: their parts quantized separately and
row-concatenated (a (N, 1) global scale of one run per part, so the route makes one cuBLAS call per part).

Per (N, K) and M: us per call in CUDA-graph replay (one call per graph; weights >= 8 MB, so the L2 flush before each
replay leaves them cold), TFLOP/s, the dequantize kernel alone, and each NVFP4 path's worst error against the float32
product on the decoded weight, relative to sum |x||w|.

Usage: python benchmarks/bench_dense_prefill.py [--rows 64,128,256,512,1024,4096] [--flush read] [--out PATH.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from megamoe.kernels.quantize import launch_dequantize  # noqa: E402
from megamoe.layers.linear import concat_rows  # noqa: E402
from megamoe.ops import gemm as gemm_ops  # noqa: E402
from megamoe.ops.quantize import dequantize, quantize  # noqa: E402

# (part rows, K, label): V4-Flash x_proj (wq_a | wkv), qr_proj (wq_b | indexer.wq_b on CSA), wo_b; V4-Pro the same
SHAPES = [((1024, 512), 4096, "Flash x_proj"), ((32768, 8192), 1024, "Flash qr_proj CSA"),
          ((4096,), 8192, "Flash wo_b"), ((1536, 512), 7168, "Pro x_proj"), ((65536, 8192), 1536, "Pro qr_proj CSA"),
          ((7168,), 16384, "Pro wo_b")]


def main():
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode

    def graph_us(fn, rep_ms):
        return graph_replay_us(fn, warmup=25, rep=rep_ms)  # do_bench's own warm-up, as measured in call f

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256,512,1024,4096")
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--min-rows", type=int, default=1,
                    help="DENSE_BF16_MIN_ROWS and DENSE_BF16_WIDE_MIN_ROWS for this run (default 1: the dense-bf16 column "
                         "at every M, to find the crossover)")
    ap.add_argument("--out", default=None)
    add_flush_argument(ap)
    args = ap.parse_args()
    use_flush_mode(args.flush)
    gemm_ops.DENSE_BF16_MIN_ROWS = gemm_ops.DENSE_BF16_WIDE_MIN_ROWS = args.min_rows
    dev = torch.device("cuda")
    lines = ["# Dense NVFP4 linears at prefill sizes\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush {args.flush}",
             f"- command: `python benchmarks/bench_dense_prefill.py --rows {args.rows} --min-rows {args.min_rows} "
             f"--flush {args.flush}`",
             "- us per call (graph replay, do_bench median). kernels = `nvfp4_linear(x, w)` (no host scale: the "
             "kernels' routes); dense-bf16 = `nvfp4_linear(x, w, host_scale=host_global_scale(w))` (dequantize + "
             "cuBLAS, from --min-rows rows; below it the same kernels); dequant = the unscaled dequantize kernel "
             "alone; bf16 = `F.linear` on a dequantized bf16 weight. err = worst |y - y32| / sum |x||w| against the "
             "float32 product on the decoded weight (x 1e-3).\n",
             "floor = max(bytes of the NVFP4 weight + scales, x and y / 3.0 TB/s, FLOPs / 749 TFLOP/s).\n",
             "| shape | N x K | M | kernels us | dense-bf16 us | dequant us | bf16 us | floor us | kernels / dense-bf16 | "
             "dense-bf16 / floor | dense-bf16 TFLOP/s | err kernels / dense-bf16 (1e-3) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for parts, k, label in SHAPES:
        torch.manual_seed(sum(parts) + k)
        w = concat_rows([quantize(torch.randn(p, k, device=dev) * k ** -0.5 * (1 + i)) for i, p in enumerate(parts)])
        n = w.shape[0]
        hs = gemm_ops.host_global_scale(w)
        wf = dequantize(w, torch.float32)
        wb = wf.bfloat16()
        one = torch.ones((1,), dtype=torch.float32, device=dev)
        w16 = torch.empty((n, k), dtype=torch.bfloat16, device=dev)
        t_dq = graph_us(lambda: launch_dequantize(w.data, w.block_scale.view(torch.uint8), one, w16,
                                                 unscaled=True), args.rep_ms)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev).bfloat16()
            t_lin = graph_us(lambda: gemm_ops.nvfp4_linear(x, w), args.rep_ms)
            t_dbf = graph_us(lambda: gemm_ops.nvfp4_linear(x, w, host_scale=hs), args.rep_ms)
            t_bf = graph_us(lambda: F.linear(x, wb), args.rep_ms)
            y32 = x.float() @ wf.t()
            mag = x.float().abs() @ wf.abs().t()
            e_lin = float(((gemm_ops.nvfp4_linear(x, w).float() - y32).abs() / mag).max())
            e_dbf = float(((gemm_ops.nvfp4_linear(x, w, host_scale=hs).float() - y32).abs() / mag).max())
            y32 = mag = None
            fl = 2 * m * n * k
            floor = max((n * k * 9 // 16 + 2 * m * (k + n)) / 3.0e6, fl / 749e6)
            lines.append(f"| {label} | {n}x{k} | {m} | {t_lin:.1f} | {t_dbf:.1f} | {t_dq:.1f} | {t_bf:.1f} | "
                         f"{floor:.1f} | {t_lin / t_dbf:.2f}x | {t_dbf / floor:.2f}x | {fl / t_dbf / 1e6:.0f} | "
                         f"{1e3 * e_lin:.2f} / {1e3 * e_dbf:.2f} |")
            print(lines[-1], flush=True)
        w = wf = wb = w16 = None
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
