"""The pipelined 64-row band alone under all-on-k routing (issue 10's skew point): kernel time.

In the MoE layer at 33-64 tokens where every token picks the same experts, the hot experts run the pipelined
64-row band (``megamoe.ops.gemm.PIPE_ABOVE_MMA_ROWS``): V4-Flash's six experts as 192 tiles of 128 columns, V4-Pro's
as 144 / 168 tiles of 256. This times that one launch (gate_up + SwiGLU, and down) as the layer plans it (its config,
row-interleaved weights, x in the MMA K order, a row gather), in CUDA-graph replay with a read flush, and reports
the weight stream rate. ``--ncu``: two eager launches per case and nothing else, for ``ncu --launch-skip 1`` (one
profiled launch per case). Part 28 used it with the K-split experiment's ``--splits`` (commit 034fd65, reverted:
``results/gpu_check_v39/b_band64*``).

Run (GPU): ``python benchmarks/probe_band64.py [--configs v4-flash,v4-pro] [--experts 6] [--rows 64] [--narrow CONFIG]
[--out FILE.md]``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))


def _case(config, gemm: str, experts: int, rows: int, device):
    """(launch(), weight bytes, band config) of one band launch: ``experts`` hot experts of ``rows`` rows among 8."""
    from gemm_helpers import offsets_of, random_codes_weight
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe
    from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order
    from megamoe.ops import gemm as gemm_ops

    h, i = config.hidden_size, config.intermediate_size
    n, k = (2 * i, h) if gemm == "gate_up" else (h, i)
    e = max(8, experts)
    w = random_codes_weight((e, n, k), device, scale_shape=(e, 1, 1)).interleave_rows(4)
    counts = [rows] * experts + [0] * (e - experts)
    t = sum(counts)
    offsets = offsets_of(counts, device)
    x = launch_to_mma_k_order(torch.randn(t, k, device=device).bfloat16())
    row_index = torch.randperm(t, device=device).to(torch.int32)
    width = n // 2 if gemm == "gate_up" else n
    out = torch.empty(t, width, dtype=torch.bfloat16, device=device)
    band = pipe.PIPE_BAND_CONFIGS[64] if n >= gemm_ops.PIPE_ABOVE_WIDE_N else pipe.PIPE_BAND64_NARROW_CONFIG

    def launch():
        return pipe.launch_nvfp4_wgmma_pipe(
            x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, row_index=row_index,
            swiglu=gemm == "gate_up", swiglu_limit=config.swiglu_limit if gemm == "gate_up" else None, config=band,
            row_lo=32, row_hi=64, x_in_mma_order=True, weight_interleave=4)

    return launch, experts * n * k * 9 // 16, band


def main() -> None:
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode
    from megamoe.models.config import PRESETS

    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="v4-flash,v4-pro")
    p.add_argument("--experts", type=int, default=6)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--narrow", default=None, help="override nvfp4_wgmma_pipe.PIPE_BAND64_NARROW_CONFIG, e.g. "
                   "64,64,128,4,3,3,168")
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--out", default=None)
    add_flush_argument(p, "read")
    args = p.parse_args()
    use_flush_mode(args.flush)
    if args.narrow:
        from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

        pipe.PIPE_BAND64_NARROW_CONFIG = tuple(int(v) for v in args.narrow.split(","))
    device = torch.device("cuda")
    lines = [f"# The pipelined 64-row band alone, {args.experts} hot experts of {args.rows} rows",
             "", f"{datetime.datetime.now().isoformat(timespec='seconds')} | {torch.cuda.get_device_name()} | torch "
             f"{torch.__version__} | `python {' '.join(sys.argv)}`", "",
             "CUDA-graph replay medians, L2 cleared before each replay; rate = weight bytes / time.", "",
             "| config | GEMM | band config | us | TB/s |", "|---|---|---|---|---|"]
    for name in args.configs.split(","):
        config = PRESETS[name]
        for gemm in ("gate_up", "down"):
            launch, nbytes, band = _case(config, gemm, args.experts, args.rows, device)
            if args.ncu:
                launch()
                launch()
                torch.cuda.synchronize()
                continue
            us = graph_replay_us(launch)
            lines.append(f"| {name} | {gemm} | {band} | {us:.1f} | {nbytes / us / 1e6:.2f} |")
            print(lines[-1], flush=True)
    if args.out and not args.ncu:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
