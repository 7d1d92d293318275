"""Tile configs of the NVFP4 dequantize kernel (``megamoe/kernels/quantize.py``, bf16 output) on the V4 dense projection
shapes: route "dense-bf16" of ``nvfp4_linear`` dequantizes the whole weight each call, so its rate sets where the route
pays. Per (N, K) and config (BLOCK_M, BLOCK_K, warps): us per call (graph replay, do_bench median) and the rate of the
bytes moved (packed codes + scales read, bf16 written).

Usage: python benchmarks/sweep_dequant.py [--flush read] [--out PATH.md]
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

from megamoe.kernels.quantize import launch_dequantize, select_config, unscaled_dequant_config  # noqa: E402

SHAPES = [(1536, 4096), (40960, 1024), (4096, 8192), (2048, 7168), (73728, 1536), (7168, 16384)]
CONFIGS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (1, 2048, 4), (4, 512, 4), (8, 512, 4),
           (16, 512, 8), (8, 256, 4), (16, 256, 4)]


def main():
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    add_flush_argument(ap)
    args = ap.parse_args()
    use_flush_mode(args.flush)
    dev = torch.device("cuda")
    lines = ["# NVFP4 dequantize kernel configs (bf16 out)\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush {args.flush}",
             f"- command: `python benchmarks/sweep_dequant.py --flush {args.flush}`",
             "- us per call (graph replay, do_bench median) and TB/s of packed codes + scales read and bf16 written; "
             "* = the config the launcher picks; rows `unscaled`: the UNSCALED path (no global scale, exact bf16; "
             "the dense-bf16 GEMM route's), the others the general path\n",
             "| N x K | " + " | ".join(f"{c}" for c in CONFIGS) + " |", "|---|" + "---|" * len(CONFIGS)]
    for n, k in SHAPES:
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        scale = torch.randint(0, 0x7E, (n, k // 16), dtype=torch.uint8, device=dev)
        one = torch.ones((1,), dtype=torch.float32, device=dev)
        out = torch.empty((n, k), dtype=torch.bfloat16, device=dev)
        nbytes = n * k // 2 + n * k // 16 + 2 * n * k
        for unscaled in (False, True):
            ref = None
            cells = []
            picked = unscaled_dequant_config(k) if unscaled else select_config("dequant", n)
            for cfg in CONFIGS:
                launch_dequantize(data, scale, one, out, config=cfg, unscaled=unscaled)
                if ref is None:
                    ref = out.clone()
                assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), cfg
                us = graph_replay_us(lambda: launch_dequantize(data, scale, one, out, config=cfg, unscaled=unscaled),
                                     warmup=25, rep=20)
                cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f}){'*' if cfg == picked else ''}")
            lines.append(f"| {n}x{k}{' unscaled' if unscaled else ''} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
