"""A/B of the pipelined wgmma kernel's ``wait_depth`` (1 = today, 2, 3: sub-steps left in flight; issue 10).

V4-Flash expert GEMMs at 4096 tokens, the kernel alone (``launch_nvfp4_wgmma_pipe`` with x already in the MMA K
order, default config): gate_up + SwiGLU (rows gathered by ``row_index``) and down, with every token on the same 6
experts (4096 rows each) and with uniform routing over 256 experts (96 rows each). For each case the three depths must
write the same bits (the same MMAs in the same order); times are CUDA-graph replays (L2 cleared before each replay,
``triton.testing.do_bench`` median), the depths alternated three times, the median of the three.

Run (H100): ``python benchmarks/ab_pipe_wait_depth.py --out DIR`` -> DIR/ab_pipe_wait_depth.{md,json}.
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
from time_pipe_kernel import TOKENS, TOPK, flash_cases  # noqa: E402 (benchmarks/, the same cases)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

    rows = []
    for routing, gemm, n, k, flops, kwargs in flash_cases(torch.device("cuda")):
        out = {d: torch.empty_like(kwargs["out"]) for d in (1, 2, 3)}

        def call(d):
            return lambda: pipe.launch_nvfp4_wgmma_pipe(**dict(kwargs, out=out[d]), wait_depth=d)

        for d in (1, 2, 3):
            call(d)()
        torch.cuda.synchronize()
        same = all(torch.equal(out[1], out[d]) for d in (2, 3))
        runs = {d: [] for d in (1, 2, 3)}
        for _ in range(3):
            for d in (1, 2, 3):
                runs[d].append(graph_replay_us(call(d), rep=60))
        us = {d: statistics.median(v) for d, v in runs.items()}
        per = TOKENS * TOPK // kwargs["expert_offsets"].shape[0]
        row = dict(routing=routing, gemm=gemm, n=n, k=k, rows_per_expert=per, same_bits=same,
                   us={str(d): us[d] for d in us}, runs={str(d): runs[d] for d in runs},
                   tflops={str(d): flops / us[d] / 1e6 for d in us})
        rows.append(row)
        print(json.dumps(row), flush=True)
        kwargs = out = None  # free before the next case
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                config=list(pipe.PIPE_CONFIG), command="python " + " ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    json.dump(dict(meta=meta, rows=rows), open(os.path.join(args.out, "ab_pipe_wait_depth.json"), "w"), indent=1)
    lines = [f"# Pipelined wgmma kernel, wait depth 1 / 2 / 3 ({meta['device']}, torch {meta['torch']}, triton "
             f"{meta['triton']}, config {meta['config']})", "", f"Command: `{meta['command']}`. V4-Flash, {TOKENS} tokens, "
             "kernel alone, graph replay, L2 cleared, median of 3 alternated runs.", "",
             "| routing | GEMM | rows / expert | same bits | depth 1 us (TFLOP/s) | depth 2 | depth 3 | 2 / 1 | 3 / 1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u, t = r["us"], r["tflops"]
        lines.append(f"| {r['routing']} | {r['gemm']} | {r['rows_per_expert']} | {r['same_bits']} | "
                     + " | ".join(f"{u[d]:.1f} ({t[d]:.0f})" for d in ("1", "2", "3"))
                     + f" | {u['2'] / u['1']:.3f} | {u['3'] / u['1']:.3f} |")
    open(os.path.join(args.out, "ab_pipe_wait_depth.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
