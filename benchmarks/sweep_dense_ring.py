"""Dense NVFP4 linear at M = 1 / 8 (issue 11): does a cp.async weight ring lift the stream rate?

Today the op takes split-K (``nvfp4_splitk``: the FMA GEMV step at M = 1, mma.sync at M = 8) and streams the large
shapes at ~61% of the HBM floor (gemm_dense_v16). The mma.sync decode kernel (``nvfp4_mma_decode``) has an opt-in
S-stage cp.async ring for the weight words and scale bytes (S - 1 K steps in flight per program instead of one in
registers); it runs without split-K, one program per BLOCK_N weight rows, so only shapes with many N tiles can
fill the GPU. This times, as CUDA-graph replay (GRAPH_CALLS calls per graph over >= 96 MB of weight copies, L2
flushed before each replay, do_bench median / calls, bench_gemm.py's ``_graph_time``):

* the op (``nvfp4_linear``, today's route), the split-K FMA config with 8 programs per SM (the v13 sweep's best
  at 18432x7168), bf16 ``F.linear``;
* ``nvfp4_mma_decode`` dense at BLOCK_M 8 for each (BLOCK_N, BLOCK_K, warps, stages) of CONFIGS.

Each kernel's output is checked against the op's (relative error < 1e-2) before it is timed.
Run: ``PYTHONUNBUFFERED=1 python benchmarks/sweep_dense_ring.py --out DIR`` -> DIR/sweep_dense_ring.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_gemm import (GRAPH_CALLS, dense_sweep_case, dense_sweep_table, dense_weight_copies,  # noqa: E402
                        sweep_meta, timed_checked)

SHAPES = [(18432, 7168), (32768, 1024), (4096, 8192), (4096, 4096)]  # (N, K)
ROWS = (1, 8)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, stages): stages 0 = register double-buffering (today's mma kernel)
CONFIGS = [(8, bn, bk, w, s) for bn, bk, w in [(64, 256, 4), (128, 256, 4), (64, 128, 4), (128, 128, 8)]
           for s in (0, 4, 6)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rep-ms", type=int, default=20)
    args = parser.parse_args()
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.kernels.gemm import nvfp4_splitk as sk
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    t0 = time.time()
    rows = []
    for n, k in SHAPES:
        ws, w_bf16 = dense_weight_copies(n, k, device)
        copies, bf16_copies = len(ws), len(w_bf16)
        for m in ROWS:
            x, out, ref, row = dense_sweep_case(ws, n, k, m, device)
            floor = row["floor_us"]

            def timed(name, make, check=True):
                timed_checked(row["times"], name, make, copies, args.rep_ms, ref if check else None)

            timed("op", lambda i: (lambda w=ws[i]: ops_gemm.nvfp4_linear(x, w, out=out)))
            timed("splitk fma 8/SM" if m == 1 else "splitk default",
                  lambda i: (lambda w=ws[i]: sk.launch_nvfp4_splitk(
                      x, w.data, w.block_scale, w.global_scale, out,
                      config=("fma", 1, 64, 256, 4, 8, 128) if m == 1 else None)))
            timed("bf16", lambda i: (lambda w=w_bf16[i % bf16_copies]: torch.nn.functional.linear(x, w)), check=False)
            for cfg in CONFIGS:
                timed(f"mma {cfg}", lambda i, c=cfg: (lambda w=ws[i]: mma.launch_nvfp4_mma_decode(
                    x, w.data, w.block_scale, w.global_scale, out, config=c)))
            rows.append(row)
            best = min((v, key) for key, v in row["times"].items() if isinstance(v, float) and key != "bf16")
            print(f"N={n} K={k} M={m} floor {floor:.1f} us: op {row['times'].get('op')} best {best[1]} "
                  f"{best[0]:.1f} us ({100 * floor / best[0]:.0f}% of floor)", flush=True)
        ws = w_bf16 = None  # free before the next shape
        torch.cuda.empty_cache()
    meta = sweep_meta(t0)
    os.makedirs(args.out, exist_ok=True)
    json.dump(dict(meta=meta, rows=rows), open(os.path.join(args.out, "sweep_dense_ring.json"), "w"), indent=1)
    lines = [f"# Dense NVFP4 linear, M = 1 / 8: weight ring vs today ({meta['date']}, {meta['device']}, "
             f"torch {meta['torch']}, triton {meta['triton']})", "", f"Command: `{meta['command']}` "
             f"(wall {meta['wall_s']} s). Graph replay, {GRAPH_CALLS} calls per graph, L2 flushed per replay, "
             "us per call (% of the HBM floor at 3.0 TB/s).", "", *dense_sweep_table(rows)]
    open(os.path.join(args.out, "sweep_dense_ring.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
