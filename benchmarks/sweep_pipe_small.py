"""The memory-bound small-row band at ~512 tokens (issue 10): how fast each tile config of the pipelined wgmma kernel
streams the touched experts, the kernel alone.

Every expert holds the same rows (``--shapes v4-flash:12``; uniform routing at 512 tokens gives ~12 rows on V4-Flash,
~8 on V4-Pro), the rows of a random uniform top-6 routing (``v4-flash:t512``), or N experts with R rows each
(``v4-flash:e7x1``, a decode step); gate_up + SwiGLU (rows gathered by ``row_index``) and down, x already in the MMA
K order. Each config is timed in CUDA-graph replay with L2 cleared (``triton.testing.do_bench`` median via
``graph_timing.graph_replay_us``), the configs alternated ``--repeats`` times and the median kept. "TB/s" counts the
FP4 bytes and E4M3 scales of every touched expert plus x and out once; "% floor" is that over 3.0 TB/s.

Configs (";"-separated), all of which must write the same bits:

* ``pipe:BLOCK_M,BLOCK_N,BLOCK_K,warps,STAGES[,per_sm[,maxnreg]]`` (``launch_nvfp4_wgmma_pipe``);
* ``mma:BLOCK_M,BLOCK_N,BLOCK_K,warps[,ring]`` (``launch_nvfp4_mma_decode``; ``@s``: split-K planned);
* ``op:`` (the grouped op's banded route with the layer's row hint);
* ``bands:HI=CONFIG|HI=CONFIG|inf=CONFIG`` (pipelined launches for the row bands (lo, HI], as
  ``megamoe.ops.gemm.plan_row_bands`` emits them);
* suffixes ``@wDEPTH`` (the pipelined kernel's wait_depth) and ``@i4`` (weights and scales with rows interleaved in
  groups of 4: ``NVFP4Tensor.interleave_rows``, ``weight_interleave``; ``op:@i4``: the op's plan for that layout).
  gpu_check_v24 call n also ran groups of 2 and 8, with an earlier version of this script that permuted the bytes
  itself and the launchers' check widened.

Run (H100): ``python benchmarks/sweep_pipe_small.py --configs "pipe:16,128,128,4,8,2;mma:16,128,128,4,4"
[--shapes v4-flash:12,v4-pro:t512] [--out DIR] [--tag T]`` -> DIR/sweep_pipe_small[_T].{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graph_timing import graph_replay_us  # noqa: E402 (benchmarks/)

SHAPES = {"v4-flash": (4096, 2048, 256), "v4-pro": (7168, 3072, 384)}  # hidden, expert I, experts
TOPK = 6
HBM_TBPS = 3.0


def cases(device, shape, rows):
    """Yield (gemm, n, k, bytes, launch kwargs) of one shape's two expert GEMMs: ``rows`` rows per expert (an int),
    or "tN": N tokens routed uniformly at random (each token's top-6 of i.i.d. uniform scores)."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order

    hidden, inter, experts = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    if str(rows).startswith("e"):  # "eNxR": N experts with R rows each (decode: 7 experts x 1 row), the rest empty
        touched, per = (int(v) for v in rows[1:].split("x"))
        counts = torch.zeros(experts, dtype=torch.int64, device=device)
        counts[torch.randperm(experts, device=device, generator=gen)[:touched]] = per
        offsets = counts.cumsum(0).to(torch.int32)
        total = touched * per
        tokens = max(1, total // TOPK)
    elif str(rows).startswith("t"):
        tokens = int(rows[1:])
        ids = torch.rand(tokens, experts, device=device, generator=gen).topk(TOPK, dim=1).indices
        counts = torch.bincount(ids.flatten(), minlength=experts)
        offsets = counts.cumsum(0).to(torch.int32)
        total = tokens * TOPK
        touched = int((counts > 0).sum())
    else:
        touched = experts
        total = int(rows) * experts
        tokens = total // TOPK
        offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * int(rows)
    row_index = torch.randint(0, tokens, (total,), dtype=torch.int32, device=device, generator=gen)
    for gemm, n, k, src, swiglu in (("gate_up", 2 * inter, hidden, tokens, True),
                                    ("down", hidden, inter, total, False)):
        data = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        scale = torch.randint(0x20, 0x48, (experts, n, k // 16), dtype=torch.uint8, device=device,
                              generator=gen).view(torch.float8_e4m3fn)
        w = NVFP4Tensor(data, scale, torch.full((experts, 1, 1), 1e-3, device=device), (experts, n, k))
        x = torch.randn(src, k, device=device, generator=gen).bfloat16()
        out = torch.empty(total, n // 2 if swiglu else n, dtype=torch.bfloat16, device=device)
        nbytes = touched * n * k * 9 // 16 + x.numel() * 2 + out.numel() * 2
        yield gemm, n, k, nbytes, dict(x=x, x_mma=launch_to_mma_k_order(x), weight=w, data=w.data,
                                       block_scale=w.block_scale,
                                       global_scale=w.global_scale, out=out, expert_offsets=offsets,
                                       row_index=row_index if swiglu else None, swiglu=swiglu,
                                       swiglu_limit=7.0 if swiglu else None,
                                       max_rows=int(torch.diff(offsets, prepend=offsets[:1] * 0).max()))


def launcher(spec, kw, out):
    """A zero-argument call of one config on the case ``kw`` writing ``out``."""
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma, nvfp4_wgmma_pipe as pipe

    kind, values = spec.split(":")
    values, planned, _ = values.partition("@s")  # "@s" (mma): split-K planned (splits=None)
    values, _, inter = values.partition("@i")  # "@i4": weights and scales with rows interleaved in groups of 4
    values, _, depth = values.partition("@w")  # "@wD": the pipelined kernel's wait_depth D
    layout = dict(weight_interleave=int(inter)) if inter else {}  # both kernels
    pipe_opts = dict(layout, **({"wait_depth": int(depth)} if depth else {}))
    if inter:
        if f"data_il{inter}" not in kw:
            w_il = kw["weight"].interleave_rows(int(inter))
            kw[f"data_il{inter}"], kw[f"scale_il{inter}"] = w_il.data, w_il.block_scale
    config = tuple(int(v) for v in values.split(",")) if kind in ("pipe", "mma") else None
    common = dict(data=kw[f"data_il{inter}" if inter else "data"],
                  block_scale=kw[f"scale_il{inter}" if inter else "block_scale"],
                  global_scale=kw["global_scale"], out=out,
                  expert_offsets=kw["expert_offsets"], row_index=kw["row_index"], swiglu=kw["swiglu"],
                  swiglu_limit=kw["swiglu_limit"])
    if kind == "pipe":
        return lambda: pipe.launch_nvfp4_wgmma_pipe(x=kw["x_mma"], x_in_mma_order=True, config=config, **pipe_opts,
                                                    **common)
    if kind == "bands":  # "HI=CONFIG|HI=CONFIG|...": pipelined launches for the row bands (lo, HI] in order
        plan, lo = [], 0
        for part in values.split("|"):
            hi, cfg = part.split("=")
            hi = pipe.ROW_HI_UNBOUNDED if hi == "inf" else int(hi)
            plan.append((lo, hi, tuple(int(v) for v in cfg.split(","))))
            lo = hi

        def run():
            for i, (lo, hi, cfg) in enumerate(plan):
                pipe.launch_nvfp4_wgmma_pipe(x=kw["x_mma"], x_in_mma_order=True, config=cfg, row_lo=lo, row_hi=hi,
                                             own_pad=i == 0, **pipe_opts, **common)
        return run
    if kind == "op":  # the grouped op's banded route as the layer runs it (megamoe.ops.gemm._launch_banded)
        from megamoe.ops import gemm as gemm_ops

        args = (kw["x"], common["data"], common["block_scale"], kw["global_scale"], out)
        return lambda: gemm_ops._launch_banded(*args, expert_offsets=kw["expert_offsets"], row_index=kw["row_index"],
                                               swiglu=kw["swiglu"], swiglu_limit=kw["swiglu_limit"],
                                               max_rows_per_expert=kw["max_rows"], **layout)
    if kind == "mma":
        extra = dict(layout, **({"splits": None} if planned else {}))
        return lambda: mma.launch_nvfp4_mma_decode(x=kw["x"], config=config, max_rows_per_expert=kw["max_rows"],
                                                   **extra, **common)
    raise ValueError(f"--configs: unknown kind {kind!r} in {spec!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help='";"-separated "pipe:..." / "mma:..." configs (module docstring)')
    ap.add_argument("--shapes", default="v4-flash:12,v4-pro:8",
                    help="SHAPE:ROWS_PER_EXPERT, SHAPE:tTOKENS (uniform routing) or SHAPE:eNxR, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    specs = args.configs.split(";")
    rows_out = []
    for item in args.shapes.split(","):
        shape, rows = item.split(":")
        for gemm, n, k, nbytes, kw in cases(dev, shape, rows):
            outs = {s: torch.empty_like(kw["out"]) for s in specs}
            calls = {s: launcher(s, kw, outs[s]) for s in specs}
            for s in specs:
                calls[s]()
            torch.cuda.synchronize()
            runs = {s: [] for s in specs}
            for _ in range(args.repeats):
                for s in specs:
                    runs[s].append(graph_replay_us(calls[s]))
            for s in specs:
                us = statistics.median(runs[s])
                tbps = nbytes / us / 1e6
                rows_out.append(dict(shape=shape, rows=rows, gemm=gemm, n=n, k=k, config=s, us=round(us, 1),
                                     tbps=round(tbps, 3), pct_floor=round(100 * tbps / HBM_TBPS, 1),
                                     same_bits=bool(torch.equal(outs[s], outs[specs[0]])),
                                     runs=[round(v, 1) for v in runs[s]]))
                print(json.dumps(rows_out[-1]), flush=True)
            kw = outs = calls = None
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "sweep_pipe_small" + (f"_{args.tag}" if args.tag else ""))
    with open(stem + ".json", "w") as f:
        json.dump(rows_out, f, indent=1)
    lines = [f"# Small-row band configs, kernel alone ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "Command: `python " + " ".join(sys.argv) + "`", "",
             "| shape | rows/expert | gemm | config | us | TB/s | % of 3.0 TB/s | same bits |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['rows']} | {r['gemm']} | `{r['config']}` | {r['us']} | {r['tbps']} "
              f"| {r['pct_floor']} "
              f"| {r['same_bits']} |" for r in rows_out]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
