"""Issue 11: how the 1-token decode GEMMs' programs share the SMs, and what smaller programs would change.

At 1 token the V4-Flash gate_up launch has 7 work chunks (6 routed experts + the fused shared expert) x 32 n-tiles
= 224 busy programs of the one-wave config (8 warps, 2 per SM): 92 SMs hold two of them and 40 hold one. If an SM's
throughput, not each program's own latency chain, sets the pace, the launch ends when the doubly loaded SMs do, and
programs of fewer warps (finer work items) would spread the same rows more evenly over the SMs.

Two sweeps, each a graph replay with the reading flush (``graph_timing``), the launcher called directly with a forced
config (x already in the paired order, row-interleaved weights, SwiGLU on gate_up):
- ``chunks``: the one-wave config with 1..8 touched groups (one row each, the same token), i.e. 32..256 programs;
- ``configs``: 7 touched groups under configs of 1, 2, 4 and 8 warps of 16 weight rows each (capped at 128
  registers, as the one-wave config) and the 4-warp default (32 rows per warp, 168 registers), for the gate_up and
  down shapes of V4-Flash and V4-Pro.

Run (H100): ``python benchmarks/probe_decode_balance.py [--out FILE]`` (~1 min)
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

# (name, groups, N, K, swiglu)
SHAPES = {
    "flash-gate_up": (257, 4096, 4096, True),
    "flash-down": (257, 4096, 2048, False),
    "pro-gate_up": (385, 6144, 7168, True),
    "pro-down": (385, 7168, 3072, False),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), register cap
CONFIGS = [((8, 128, 256, 4), 168), ((8, 128, 256, 8), 128), ((8, 64, 256, 4), 128), ((8, 32, 256, 2), 128),
           ((8, 32, 256, 2), 136), ((8, 16, 256, 1), 128)]


def main(argv=None) -> int:
    from graph_timing import add_flush_argument, flush_mode, graph_replay_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--touched", type=int, default=7)
    add_flush_argument(ap, default="read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_balance.py needs a CUDA GPU")
        return 0
    from gemm_helpers import random_codes_weight

    from megamoe.format.mma_order import to_paired_order
    from megamoe.kernels.gemm import nvfp4_mma_decode as dec

    dev = torch.device("cuda")
    torch.manual_seed(0)
    lines = []

    def time_one(w, x, touched, groups, n, swiglu, config, cap):
        dec.DECODE_MAXNREG[tuple(config)] = cap
        chosen = torch.randperm(groups - 1)[:touched]
        counts = torch.zeros(groups, dtype=torch.int64)
        counts[chosen] = 1
        offsets = counts.cumsum(0).to(torch.int32).to(dev)
        row_index = torch.zeros(touched, dtype=torch.int32, device=dev)
        out = torch.empty(touched, n // 2 if swiglu else n, dtype=torch.bfloat16, device=dev)

        def call():
            dec.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                        row_index=row_index, swiglu=swiglu, swiglu_limit=10.0 if swiglu else None,
                                        config=config, max_rows_per_expert=1, weight_interleave=4, x_paired=True)

        call()
        torch.cuda.synchronize()
        with flush_mode(args.flush):
            return sorted(graph_replay_us(call, warmup=20, rep=200) for _ in range(3))[1]

    for name in args.shapes.split(","):
        groups, n, k, swiglu = SHAPES[name]
        w = random_codes_weight((groups, n, k), dev, scale_shape=(groups, 1, 1)).interleave_rows(4)
        x = to_paired_order(torch.randn(1, k, device=dev).bfloat16())
        bytes_per_group = n * k * (0.5 + 1 / 16) / 1e6
        if name == "flash-gate_up":
            lines += [f"## {name}: the one-wave config (8, 128, 256, 8) at 128 registers, 1..8 touched groups", "",
                      "| touched | programs busy | us | MB | TB/s |", "|---|---|---|---|---|"]
            for touched in range(1, 9):
                us = time_one(w, x, touched, groups, n, swiglu, (8, 128, 256, 8), 128)
                mb = touched * bytes_per_group
                lines.append(f"| {touched} | {touched * triton.cdiv(n, 128)} | {us:.2f} | {mb:.1f} | {mb / us:.2f} |")
                print(lines[-1], flush=True)
            lines.append("")
        lines += [f"## {name}: {args.touched} touched groups by config (N {n}, K {k})", "",
                  "| config | cap | programs busy | us | TB/s |", "|---|---|---|---|---|"]
        for config, cap in CONFIGS:
            try:
                us = time_one(w, x, args.touched, groups, n, swiglu, config, cap)
            except Exception as exc:  # noqa: BLE001 - a config the kernel cannot build is a row, not a crash
                lines.append(f"| {config} | {cap} | - | failed: {type(exc).__name__}: {str(exc)[:80]} | - |")
                print(lines[-1], flush=True)
                continue
            mb = args.touched * bytes_per_group
            busy = args.touched * triton.cdiv(n, config[1])
            lines.append(f"| {config} | {cap} | {busy} | {us:.2f} | {mb / us:.2f} |")
            print(lines[-1], flush=True)
        lines.append("")
        del w
        torch.cuda.empty_cache()
    if args.out:
        head = [f"# Decode GEMM programs per SM at 1 token ({torch.cuda.get_device_name()})", "",
                f"- {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; torch "
                f"{torch.__version__}; triton {triton.__version__}", f"- command: `python {' '.join(sys.argv)}`",
                f"- graph replay, do_bench median ({args.flush} flush), middle of 3; one row per touched group (the "
                "same token), row-interleaved weights, x in the paired order", ""]
        with open(args.out, "w") as f:
            f.write("\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
