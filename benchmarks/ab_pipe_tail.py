"""A/B of the pipelined wgmma kernel's tail tiles (issue 10; NOTES_gemm.md v20): 96-row (64 + 32) vs 128-row tiles
for experts of 96 rows, and 48-row (32 + 16) vs 64-row tiles for experts of 48 rows; or any two configs (``--pairs``).

V4-Flash expert GEMMs, the kernel alone (``launch_nvfp4_wgmma_pipe``, x already in the MMA K order), uniform routing
with every expert holding the same rows: 4096 tokens (96 rows per expert) and 2048 tokens (48). gate_up + SwiGLU (rows
gathered by ``row_index``) and down. Both tiles must write the same bits (the same products in the same k16 order per
output element). Times: CUDA-graph replays, L2 cleared before each, ``triton.testing.do_bench`` median; the two
configs alternated three times, the median of the three. TFLOP/s count the real rows only.

Run (H100): ``python benchmarks/ab_pipe_tail.py --out DIR [--pairs ...] [--tag T]`` -> DIR/ab_pipe_tail[_T].{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timing import graph_replay_us  # noqa: E402 (benchmarks/)
from time_pipe_kernel import TOPK, flash_cases  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--pairs", default=None,
                    help='"TOKENS:CONFIG_A:CONFIG_B;..." (CONFIG = BLOCK_M,BLOCK_N,BLOCK_K,num_warps,STAGES), e.g. '
                         '"2048:64,256,128,8,4:64,256,128,8,6"; default: 4096 128 vs 96 rows, 2048 64 vs 48 rows')
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

    pairs = [(4096, pipe.PIPE_CONFIG, pipe.PIPE_TAIL_CONFIGS[96]), (2048, pipe.PIPE_BAND_CONFIGS[64],
                                                                     pipe.PIPE_BM48_CONFIG)]
    if args.pairs:
        pairs = []
        for item in args.pairs.split(";"):
            tokens, a, b = item.split(":")
            pairs.append((int(tokens), tuple(int(v) for v in a.split(",")), tuple(int(v) for v in b.split(","))))
    rows = []
    for tokens, power, tail in pairs:
        for routing, gemm, n, k, flops, kwargs in flash_cases(torch.device("cuda"), tokens, ("uniform",)):
            configs = {"power": power, "tail": tail}
            out = {name: torch.empty_like(kwargs["out"]) for name in configs}

            def call(name):
                return lambda: pipe.launch_nvfp4_wgmma_pipe(**dict(kwargs, out=out[name]), config=configs[name])

            for name in configs:
                call(name)()
            torch.cuda.synchronize()
            same = torch.equal(out["power"], out["tail"])
            runs = {name: [] for name in configs}
            for _ in range(3):
                for name in configs:
                    runs[name].append(graph_replay_us(call(name), rep=60))
            us = {name: statistics.median(v) for name, v in runs.items()}
            row = dict(tokens=tokens, gemm=gemm, n=n, k=k, rows_per_expert=tokens * TOPK // 256, same_bits=same,
                       configs={name: list(c) for name, c in configs.items()}, us=us, runs=runs,
                       tflops={name: flops / us[name] / 1e6 for name in us}, speedup=us["power"] / us["tail"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            kwargs = out = None
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    json.dump(dict(meta=meta, rows=rows), open(os.path.join(args.out, f"ab_pipe_tail{tag}.json"), "w"), indent=1)
    lines = [f"# Pipelined wgmma kernel: tail tiles vs power-of-two tiles ({meta['device']}, torch {meta['torch']}, "
             f"triton {meta['triton']})", "", f"Command: `{meta['command']}`. V4-Flash, uniform routing (every expert "
             "the same rows), kernel alone, graph replay, L2 cleared, median of 3 alternated runs.", "",
             "| tokens | GEMM | rows / expert | A us (TFLOP/s, config) | B us (TFLOP/s, config) | A / B | same bits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        u, t = r["us"], r["tflops"]
        c = {name: ",".join(str(v) for v in r["configs"][name]) for name in ("power", "tail")}
        lines.append(f"| {r['tokens']} | {r['gemm']} | {r['rows_per_expert']} | {u['power']:.1f} ({t['power']:.0f}, "
                     f"{c['power']}) | {u['tail']:.1f} ({t['tail']:.0f}, {c['tail']}) | {r['speedup']:.3f}x | "
                     f"{r['same_bits']} |")
    open(os.path.join(args.out, f"ab_pipe_tail{tag}.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
