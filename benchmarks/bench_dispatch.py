"""MoE dispatch (stable grouping of the (token, slot) pairs by expert): the one-program sort kernel
(``megamoe/kernels/moe_dispatch.py``) vs its first version (a single program over 32-pair chunks, kept here as
the baseline) and the torch path (radix sort + searchsorted + scatter), V4-Flash groups (256 experts + the fused
shared slot: 257 groups, 7 slots per token).

CUDA-graph replay, L2 cleared, ``triton.testing.do_bench`` median; outputs checked equal across the three. A second
table: prefill sizes, the blocked kernels (``launch_moe_dispatch_blocked``) against the one-program sort and torch.
Run (H100): ``python benchmarks/bench_dispatch.py [--out DIR]`` -> DIR/bench_dispatch.md.
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


@triton.jit
def _chunked_v1_kernel(ids_ptr, offsets_ptr, sorted_expert_ptr, row_index_ptr, inv_perm_ptr, num_pairs, num_groups,
                       TOP_K: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """The first version (until 2026-11-26, without its error flag): histogram pass, then ranks per 32-pair chunk."""
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    start = 0
    while start < num_pairs:
        p = start + lanes
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=BINS - 1)
        e = tl.where(p < num_pairs, e, num_groups)
        counts += tl.histogram(e, BINS)
        start += BLOCK
    counts = tl.where(bins < num_groups, counts, 0)
    ends = tl.cumsum(counts, 0)
    tl.store(offsets_ptr + bins, ends, mask=bins < num_groups)
    running = ends - counts
    start = 0
    while start < num_pairs:
        p = start + lanes
        valid = p < num_pairs
        e = tl.load(ids_ptr + p, mask=valid, other=BINS - 1)
        e = tl.where(valid, e, num_groups)
        earlier_same = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        base = tl.sum(tl.where(e[:, None] == bins[None, :], running[None, :], 0), axis=1)
        row = base + rank
        tl.store(inv_perm_ptr + p, row, mask=valid)
        tl.store(sorted_expert_ptr + row, e, mask=valid)
        tl.store(row_index_ptr + row, p // TOP_K, mask=valid)
        running += tl.histogram(e, BINS)
        start += BLOCK



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from megamoe.kernels.moe_dispatch import launch_moe_dispatch
    from megamoe.ops import moe as moe_ops

    dev = torch.device("cuda")
    groups, slots = 257, 7
    lines = [f"# MoE dispatch ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
             "", "Command: `python " + " ".join(sys.argv) + "`. 257 groups, 7 slots per token; graph replay, L2 "
             "cleared, median us.", "", "| tokens | pairs | sort kernel | first version | torch path | first / sort | "
             "torch / sort |", "|---|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 8, 16, 32, 64, 128, 256, 1024):
        ids = torch.stack([torch.randperm(groups - 1, generator=gen)[:slots] for _ in range(tokens)]).int().to(dev)
        flat = ids.flatten().contiguous()
        pairs = flat.numel()
        outs = {v: [torch.empty(groups, dtype=torch.int32, device=dev)] +
                [torch.empty(pairs, dtype=torch.int32, device=dev) for _ in range(3)] for v in ("sort", "v1")}
        bufs = {"expert_offsets": torch.empty(groups, dtype=torch.int32, device=dev)}

        def v1():
            o = outs["v1"]
            _chunked_v1_kernel[(1,)](flat, o[0], o[1], o[2], o[3], pairs, groups, TOP_K=slots,
                                     BINS=triton.next_power_of_2(groups + 1), BLOCK=32, num_warps=4)

        fns = {"sort": lambda: launch_moe_dispatch(flat, slots, groups, *outs["sort"]), "v1": v1,
               "torch": lambda: moe_ops.dispatch(ids, groups, buffers=bufs, backend="torch")}
        us = {v: graph_replay_us(f, warmup=20, rep=200) for v, f in fns.items()}
        ref = moe_ops.dispatch(ids, groups, backend="torch")
        for v in ("sort", "v1"):
            for i, key in enumerate(("expert_offsets", "sorted_expert", "row_index", "inv_perm")):
                assert torch.equal(outs[v][i], ref[key]), (v, key, tokens)
        lines.append(f"| {tokens} | {pairs} | {us['sort']:.1f} | {us['v1']:.1f} | {us['torch']:.1f} | "
                     f"{us['v1'] / us['sort']:.2f}x | {us['torch'] / us['sort']:.2f}x |")
        print(lines[-1], flush=True)
        outs = bufs = ids = flat = fns = None
    # prefill sizes: the blocked kernels (two launches) vs the one-program sort (while it holds the pairs) and torch
    from megamoe.kernels.moe_dispatch import DISPATCH_BLOCK, launch_moe_dispatch_blocked

    lines += ["", f"## Prefill sizes: the blocked kernels ({DISPATCH_BLOCK} pairs per program)", "",
              "| tokens | pairs | blocked | one-program sort | torch path | torch / blocked |", "|---|---|---|---|---|---|"]
    for tokens in (256, 512, 1024, 2048, 4096, 8192, 16384):
        ids = torch.randint(0, groups - 1, (tokens, slots), dtype=torch.int32, device=dev)
        flat = ids.flatten().contiguous()
        pairs = flat.numel()
        outs = {v: [torch.empty(groups, dtype=torch.int32, device=dev)] +
                [torch.empty(pairs, dtype=torch.int32, device=dev) for _ in range(3)] for v in ("blocked", "sort")}
        bufs = {"expert_offsets": torch.empty(groups, dtype=torch.int32, device=dev)}
        fns = {"blocked": lambda: launch_moe_dispatch_blocked(flat, slots, groups, *outs["blocked"]),
               "torch": lambda: moe_ops.dispatch(ids, groups, buffers=bufs, backend="torch")}
        if pairs <= 8192:
            fns["sort"] = lambda: launch_moe_dispatch(flat, slots, groups, *outs["sort"])
        us = {v: graph_replay_us(f, warmup=20, rep=200) for v, f in fns.items()}
        ref = moe_ops.dispatch(ids, groups, backend="torch")
        for v in [v for v in ("blocked", "sort") if v in fns]:
            for i, key in enumerate(("expert_offsets", "sorted_expert", "row_index", "inv_perm")):
                assert torch.equal(outs[v][i], ref[key].int()), (v, key, tokens)
        sort_us = f"{us['sort']:.1f}" if "sort" in us else "-"
        lines.append(f"| {tokens} | {pairs} | {us['blocked']:.1f} | {sort_us} | {us['torch']:.1f} | "
                     f"{us['torch'] / us['blocked']:.2f}x |")
        print(lines[-1], flush=True)
        outs = bufs = ids = flat = fns = None
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "bench_dispatch.md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
