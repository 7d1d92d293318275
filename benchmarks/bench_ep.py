"""Expert-parallel MoE layer benchmark (GPU, NCCL): EP at 1..4096 tokens per rank vs one GPU.

    torchrun --nproc-per-node N benchmarks/bench_ep.py [--config v4-flash] [--tokens 1,8,64,256,1024,4096]
             [--graph-max 256] [--out benchmarks/results/ep_v1.json]

Per tokens-per-rank T (medians of CUDA-event timings, rank 0 prints, every rank measures):
* ``ep_exact``: eager EP forward with exact split sizes (host reads the counts);
* ``ep_graph``: CUDA-graph replay of the capacity-mode forward (T <= --graph-max), on a layer whose capacity is T
  (as a decode deployment sizes it; the other columns use one layer with capacity --graph-max);
* ``a2a_exact`` / ``a2a_capacity``: the two row all-to-alls alone (dispatch + return, same byte counts as the
  layer: exact = this step's received rows, capacity = W * T * k rows per direction), timed in isolation;
* ``single_T`` / ``single_WT``: one GPU holding every expert (Nvfp4MoE, graph replay up to --graph-max, else
  eager) at T and at W*T tokens (the same total work as the EP step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout (torchrun)


def _time(fn, iters: int = 10, warmup: int = 3, collective: bool = True, calls: int = 10) -> float:
    """Median over ``iters`` batches of the per-call time of ``calls`` back-to-back calls (us).

    collective: every rank times ``fn`` together, with a barrier before each batch; back-to-back calls keep the
    ranks in step through their collectives, as consecutive decode steps do (one call per batch measured each
    rank's host skew as well: the first run's ~73 us per all-to-all of 49 KB). False: one rank's own timing (a
    barrier there would pair with another collective of the other ranks and desynchronise the group)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if collective:
            dist.barrier()
            torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    from megamoe.distributed import ExpertParallelMoE, init_from_env, shutdown
    from megamoe.layers import Nvfp4MoE
    from megamoe.models.config import PRESETS

    p = argparse.ArgumentParser()
    p.add_argument("--config", default="v4-flash")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--graph-max", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = init_from_env("cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = PRESETS[args.config]
    token_list = [int(t) for t in args.tokens.split(",")]
    t_max = max(token_list)
    graph_max = min(args.graph_max, t_max)
    ep = ExpertParallelMoE.random(c, seed=0, max_num_tokens=t_max, capacity_tokens=graph_max, device=dev)
    single = Nvfp4MoE.random(c, seed=0, max_num_tokens=world * t_max, device=dev) if rank == 0 else None
    rows = []
    for t in token_list:
        x = torch.randn(t, c.hidden_size, device=dev).to(torch.bfloat16)
        row = {"tokens_per_rank": t, "world": world}
        row["ep_exact_us"] = _time(lambda: ep.forward(x))
        received = int(ep._recv_counts.sum())  # last exact step's received pairs (host read, outside timing)
        h = c.hidden_size
        send = torch.empty(t * c.top_k, h, dtype=torch.bfloat16, device=dev)
        recv = torch.empty(received, h, dtype=torch.bfloat16, device=dev)
        sizes = torch.tensor([t * c.top_k, received], device=dev)
        counts = [torch.zeros(2, dtype=torch.long, device=dev) for _ in range(world)]
        dist.all_gather(counts, sizes)
        del counts
        in_splits = [t * c.top_k // world] * world
        in_splits[-1] += t * c.top_k - sum(in_splits)
        splits_all = [torch.zeros(world, dtype=torch.long, device=dev) for _ in range(world)]
        dist.all_gather(splits_all, torch.tensor(in_splits, device=dev))
        out_splits = [int(s[rank]) for s in splits_all]
        recv = torch.empty(sum(out_splits), h, dtype=torch.bfloat16, device=dev)
        row["a2a_exact_us"] = _time(lambda: (dist.all_to_all_single(recv, send, out_splits, in_splits),
                                             dist.all_to_all_single(send, recv, in_splits, out_splits)))
        row["a2a_exact_note"] = "even split of this rank's T*k rows over the peers (routing-independent)"
        if t <= graph_max:
            # a decode deployment sizes the capacity to its batch: a layer with capacity_tokens = t for the graph
            # (the shared one's capacity is graph_max: at t = 1 it would exchange and multiply 256x the rows)
            ep_t = ep if t == graph_max else ExpertParallelMoE.random(c, seed=0, max_num_tokens=t, capacity_tokens=t,
                                                                        device=dev)
            replay = ep_t.capture(t)
            row["ep_graph_us"] = _time(lambda: replay(x))
            replay = None
            cap = world * ep_t.capacity_rows
            ep_t = None
            cs, cr = torch.empty(cap, h, dtype=torch.bfloat16, device=dev), torch.empty(cap, h, dtype=torch.bfloat16,
                                                                                       device=dev)
            row["a2a_capacity_us"] = _time(lambda: (dist.all_to_all_single(cr, cs), dist.all_to_all_single(cs, cr)))
            row["capacity_bytes_per_direction"] = cap * h * 2
        if rank == 0:
            for name, n in (("single_T_us", t), ("single_WT_us", world * t)):
                xs = torch.randn(n, h, device=dev).to(torch.bfloat16)
                if n <= graph_max:
                    run = single.capture(n)
                    row[name] = _time(lambda: run(xs), collective=False)
                    run = None
                else:
                    row[name] = _time(lambda: single.forward(xs), collective=False)
        dist.barrier()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row))
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": c.name, "world": world, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
    shutdown(dev)  # every graph closure above is dropped: shutdown collects them before destroying the group


if __name__ == "__main__":
    main()
