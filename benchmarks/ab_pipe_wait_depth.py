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

HIDDEN, INTER, TOKENS, TOPK = 4096, 2048, 4096, 6


def _weight(e, n, k, device):
    from megamoe.format.tensor import NVFP4Tensor

    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.randint(0x20, 0x48, (e, n, k // 16), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return NVFP4Tensor(data, scale, torch.full((e, 1, 1), 1e-3, device=device), (e, n, k))


def _graph_us(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe
    from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order

    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for routing, experts in (("all-on-6", TOPK), ("uniform", 256)):
        per = TOKENS * TOPK // experts
        offsets = (torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per)
        row_index = torch.randint(0, TOKENS, (TOKENS * TOPK,), dtype=torch.int32, device=device)
        for gemm, n, k, src, swiglu in (("gate_up", 2 * INTER, HIDDEN, TOKENS, True),
                                        ("down", HIDDEN, INTER, TOKENS * TOPK, False)):
            w = _weight(experts, n, k, device)
            x = launch_to_mma_k_order(torch.randn(src, k, device=device).bfloat16())
            out = {d: torch.empty(TOKENS * TOPK, n // 2 if swiglu else n, dtype=torch.bfloat16, device=device)
                   for d in (1, 2, 3)}

            def call(d):
                return lambda: pipe.launch_nvfp4_wgmma_pipe(
                    x, w.data, w.block_scale, w.global_scale, out[d], expert_offsets=offsets,
                    row_index=row_index if swiglu else None, swiglu=swiglu, swiglu_limit=7.0 if swiglu else None,
                    x_in_mma_order=True, wait_depth=d)

            for d in (1, 2, 3):
                call(d)()
            torch.cuda.synchronize()
            same = all(torch.equal(out[1], out[d]) for d in (2, 3))
            runs = {d: [] for d in (1, 2, 3)}
            for _ in range(3):
                for d in (1, 2, 3):
                    runs[d].append(_graph_us(call(d)))
            us = {d: statistics.median(v) for d, v in runs.items()}
            flops = 2 * TOKENS * TOPK * n * k
            row = dict(routing=routing, gemm=gemm, n=n, k=k, rows_per_expert=per, same_bits=same,
                       us={str(d): us[d] for d in us}, runs={str(d): runs[d] for d in runs},
                       tflops={str(d): flops / us[d] / 1e6 for d in us})
            rows.append(row)
            print(json.dumps(row), flush=True)
            w = x = out = None  # free before the next case
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
