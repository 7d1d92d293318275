"""Dense NVFP4 linears at prefill sizes (the V4 attention projections): ``nvfp4_linear``'s route against the
pipelined wgmma kernel the MoE layer uses, launched as a grouped GEMM of one expert holding every row
(``nvfp4_grouped_mm(x, W[None], offsets=[M])``), and against bf16 ``F.linear`` (cuBLAS) on the dequantized weight.

Per (N, K) and M: us per call in CUDA-graph replay (one call per graph; weights >= 8 MB, so the L2 flush before each
replay leaves them cold), TFLOP/s, and each NVFP4 path's worst error against the float32 product on the decoded
weight, relative to sum |x||w| (the same check for both: they compute the same dot products in another order).

Usage: python benchmarks/bench_dense_prefill.py [--rows 256,512,1024,4096] [--flush read] [--out PATH.md]
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

from megamoe.format.tensor import NVFP4Tensor  # noqa: E402
from megamoe.ops import gemm as gemm_ops  # noqa: E402
from megamoe.reference.quantize import dequantize, quantize  # noqa: E402

# (N, K, label): V4-Flash x_proj (wq_a | wkv), qr_proj (wq_b | indexer.wq_b on CSA), wo_b; V4-Pro the same
SHAPES = [(1536, 4096, "Flash x_proj"), (40960, 1024, "Flash qr_proj CSA"), (4096, 8192, "Flash wo_b"),
          (2048, 7168, "Pro x_proj"), (73728, 1536, "Pro qr_proj CSA"), (7168, 16384, "Pro wo_b")]


def main():
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode

    def graph_us(fn, rep_ms):
        return graph_replay_us(fn, warmup=25, rep=rep_ms)  # do_bench's own warm-up, as measured in call f

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,512,1024,4096")
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--out", default=None)
    add_flush_argument(ap)
    args = ap.parse_args()
    use_flush_mode(args.flush)
    dev = torch.device("cuda")
    lines = ["# Dense NVFP4 linears at prefill sizes\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush {args.flush}",
             f"- command: `python benchmarks/bench_dense_prefill.py --rows {args.rows} --flush {args.flush}`",
             "- us per call (graph replay, do_bench median). linear = `nvfp4_linear` as routed; pipe = "
             "`nvfp4_grouped_mm(x, W[None], offsets=[M])` (the pipelined wgmma kernel); bf16 = `F.linear` on the "
             "dequantized weight. err = worst |y - y32| / sum |x||w| against the float32 product (x 1e-3).\n",
             "| shape | N x K | M | linear us | pipe us | bf16 us | linear TFLOP/s | pipe TFLOP/s | pipe / linear | "
             "err linear / pipe (1e-3) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, k, label in SHAPES:
        torch.manual_seed(n + k)
        w = quantize(torch.randn(n, k, device=dev) * k ** -0.5)
        w3 = NVFP4Tensor(w.data[None], w.block_scale[None], w.global_scale.reshape(()), (1, n, k))
        wb = dequantize(w, torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev).bfloat16()
            offsets = torch.full((1,), m, dtype=torch.int32, device=dev)
            t_lin = graph_us(lambda: gemm_ops.nvfp4_linear(x, w), args.rep_ms)
            t_pipe = graph_us(lambda: gemm_ops.nvfp4_grouped_mm(x, w3, offsets, max_rows_per_expert=m), args.rep_ms)
            t_bf = graph_us(lambda: F.linear(x, wb), args.rep_ms)
            y32 = x.float() @ wb.float().t()
            mag = x.float().abs() @ wb.float().abs().t()
            e_lin = float(((gemm_ops.nvfp4_linear(x, w).float() - y32).abs() / mag).max())
            e_pipe = float(((gemm_ops.nvfp4_grouped_mm(x, w3, offsets, max_rows_per_expert=m).float() - y32).abs()
                            / mag).max())
            fl = 2 * m * n * k
            lines.append(f"| {label} | {n}x{k} | {m} | {t_lin:.1f} | {t_pipe:.1f} | {t_bf:.1f} | "
                         f"{fl / t_lin / 1e6:.0f} | {fl / t_pipe / 1e6:.0f} | {t_lin / t_pipe:.2f}x | "
                         f"{1e3 * e_lin:.2f} / {1e3 * e_pipe:.2f} |")
            print(lines[-1], flush=True)
        w = w3 = wb = None
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
