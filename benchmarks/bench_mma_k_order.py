"""The MMA-K-order activation copy (``megamoe/kernels/gemm/mma_k_order.py``) against its first version, the
PyTorch ``index_select`` reference and a plain copy (``clone``, the floor), on the prefill GEMM inputs: V4-Flash
gate_up x (4096 x 4096) and down h (24576 x 2048), V4-Pro at 8192 tokens (8192 x 7168, 49152 x 3072).

CUDA-graph replay, L2 cleared before each replay, ``triton.testing.do_bench`` median. The first version (one 2-byte
gathered load per element, 32 rows per program) is kept here as the baseline. Every variant's output is checked
against the reference.

Run (H100): ``python benchmarks/bench_mma_k_order.py [--out DIR]`` -> DIR/bench_mma_k_order.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_replay_us  # noqa: E402 (benchmarks/)

SHAPES = (("V4-Flash gate_up x, 4096 tokens", 4096, 4096), ("V4-Flash down h, 4096 tokens", 24576, 2048),
          ("V4-Pro gate_up x, 8192 tokens", 8192, 7168), ("V4-Pro down h, 8192 tokens", 49152, 3072))


@triton.jit
def _gather_v1_kernel(x_ptr, out_ptr, num_rows, stride_xm, stride_om, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """The first version (2026-11-25 to 11-26): gathered 2-byte loads within each K group, contiguous stores."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    base = tl.program_id(1) * GROUP
    kappa = tl.arange(0, GROUP)
    m = (GROUP // 4) * ((kappa >> 1) & 3) + 8 * (kappa >> 5) + 4 * ((kappa >> 3) & 1) + 2 * (kappa & 1) + \
        ((kappa >> 4) & 1)
    mask = (rows < num_rows)[:, None]
    r = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r * stride_xm + base + m[None, :], mask=mask)
    tl.store(out_ptr + r * stride_om + base + kappa[None, :], v, mask=mask)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from megamoe.format.mma_order import to_mma_k_order
    from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order

    lines = [f"# MMA-K-order copy ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__})", "", "Command: `python " + " ".join(sys.argv) + "`. Graph replay, L2 cleared, "
             "median; GB/s = (read + write) / time.", "",
             "| input | M x K | clone (floor) us | this kernel us (GB/s) | first version us (GB/s) | index_select us | "
             "first / this |", "|---|---|---|---|---|---|---|"]
    for name, m, k in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = to_mma_k_order(x)
        outs = {v: torch.empty_like(x) for v in ("clone", "new", "v1", "torch")}

        def v1():
            _gather_v1_kernel[(triton.cdiv(m, 32), k // 128)](x, outs["v1"], m, x.stride(0), k, BLOCK_R=32, GROUP=128,
                                                              num_warps=4)

        fns = {"clone": lambda: outs["clone"].copy_(x), "new": lambda: launch_to_mma_k_order(x, out=outs["new"]),
               "v1": v1, "torch": lambda: to_mma_k_order(x, out=outs["torch"])}
        us = {v: graph_replay_us(f) for v, f in fns.items()}
        for v in ("new", "v1", "torch"):
            assert torch.equal(outs[v], ref), (name, v)
        gb = 2 * x.numel() * 2 / 1e3
        lines.append(f"| {name} | {m} x {k} | {us['clone']:.1f} | {us['new']:.1f} ({gb / us['new']:.0f}) | "
                     f"{us['v1']:.1f} ({gb / us['v1']:.0f}) | {us['torch']:.1f} | {us['v1'] / us['new']:.2f}x |")
        print(lines[-1], flush=True)
        x = ref = outs = fns = None  # free before the next shape
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "bench_mma_k_order.md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
