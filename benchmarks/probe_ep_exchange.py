"""Where an expert-parallel decode step goes, and what the exchange itself could cost (GPU, NCCL, >= 2 ranks).

    torchrun --nproc-per-node 2 benchmarks/probe_ep_exchange.py [--config v4-flash] [--tokens 1,8,64]
             [--exchange auto,nccl] [--out F.md]

Per tokens-per-rank T (a layer whose capacity is T, as a decode deployment sizes it):
* for each ``--exchange`` setting of the layer, the capacity-mode EP forward in one CUDA graph: time per replay
  (batches of back-to-back replays, a barrier before each batch), and rank 0's kernels of one replay by name
  (torch.profiler): count and GPU time, split into NCCL kernels, the grouped GEMMs and the rest (the routing /
  dispatch / reordering glue, the peer stores and barriers);
* the exchange primitives alone, each captured 16 times into one graph: NCCL ``all_to_all_single`` of the
  counts (E int32) and of the capacity rows (W * T * k bf16 rows of H), ``all_gather_into_tensor`` of T rows;
* the same bytes over NVLink peer-to-peer (``torch.distributed._symmetric_memory``, no multicast): a copy into
  the peer's buffer followed by the handle's barrier, and the barrier alone.
Rank 0 writes a markdown table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout (torchrun)


def _time_graph(graph, calls: int, iters: int = 15, batch: int = 10) -> float:
    """Median over ``iters`` batches of ``batch`` back-to-back replays (barrier before each batch), us per call."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (batch * calls))
    return statistics.median(times)


def _capture(fn, reps: int):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def _kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "nvfp4" in n or "wgmma" in n or "mma_decode" in n or "gemv" in n:
        return "gemm"
    return "glue"


def main() -> None:
    from megamoe.distributed import ExpertParallelMoE, init_from_env, shutdown
    from megamoe.models.config import PRESETS

    p = argparse.ArgumentParser()
    p.add_argument("--config", default="v4-flash")
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--exchange", default="auto", help="comma-separated ExpertParallelMoE exchange settings")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = init_from_env("cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = PRESETS[args.config]
    h, k, e = c.hidden_size, c.top_k, c.num_experts
    lines = [f"# EP exchange probe: {c.name}, world {world}",
             "",
             f"- {datetime.datetime.now().isoformat(timespec='seconds')} | {torch.cuda.get_device_name()} | "
             f"torch {torch.__version__} | NCCL {torch.cuda.nccl.version()} | "
             f"`torchrun --nproc-per-node {world} benchmarks/probe_ep_exchange.py --tokens {args.tokens}`",
             "- times: CUDA events over batches of 10 back-to-back graph replays after a barrier, median of 15, us",
             ""]
    reps = 16
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm = symm_mem
    except Exception as exc:  # noqa: BLE001
        lines.append(f"- symmetric memory unavailable: {exc!r}")
    for t in [int(x) for x in args.tokens.split(",")]:
        lines += [f"## {t} tokens per rank", ""]
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        for exchange in args.exchange.split(","):
            kw = {} if exchange == "legacy" else {"exchange": exchange}  # "legacy": code without the option
            layer = ExpertParallelMoE.random(c, seed=0, max_num_tokens=t, capacity_tokens=t, device=dev, **kw)
            run = layer.capture(t)
            run(x)
            step_us = _time_graph(run.graph, 1)
            from torch.profiler import ProfilerActivity, profile
            dist.barrier()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    run.graph.replay()
                torch.cuda.synchronize()
            dist.barrier()
            stats = collections.defaultdict(lambda: [0, 0.0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
                    s = stats[ev.name]
                    s[0] += 1
                    s[1] += ev.device_time_total
            per_kind = collections.defaultdict(lambda: [0, 0.0])
            for name, (n, us) in stats.items():
                kk = per_kind[_kind(name)]
                kk[0] += n
                kk[1] += us
            lines.append(f"- EP forward (exchange {getattr(layer, 'exchange', 'nccl')}), capacity mode, graph replay: "
                         f"**{step_us:.1f} us** per step ({world * layer.capacity_rows} receive rows)")
            for kind_name, (n, us) in sorted(per_kind.items()):
                lines.append(f"  - {kind_name}: {n / 5:.0f} kernels, {us / 5:.1f} us GPU time per step")
            lines += ["", "| kernel | per step | us per step |", "|---|---|---|"]
            for name, (n, us) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:args.top]:
                lines.append(f"| `{name[:90]}` | {n / 5:.0f} | {us / 5:.1f} |")
            lines.append("")
            run = None
            layer = None
            torch.cuda.synchronize()
        # primitives
        cap = world * t * k
        counts_s = torch.zeros(e, dtype=torch.int32, device=dev)
        counts_r = torch.zeros_like(counts_s)
        rows_s = torch.zeros(cap, h, dtype=torch.bfloat16, device=dev)
        rows_r = torch.zeros_like(rows_s)
        gat_r = torch.zeros(world * t, h, dtype=torch.bfloat16, device=dev)
        prims = {
            "nccl all_to_all_single counts (E int32)": lambda: dist.all_to_all_single(counts_r, counts_s),
            f"nccl all_to_all_single rows ({cap} x {h} bf16)": lambda: dist.all_to_all_single(rows_r, rows_s),
            f"nccl all_gather_into_tensor ({t} x {h} bf16 per rank)":
                lambda: dist.all_gather_into_tensor(gat_r, x),
        }
        rowsb = cap * h * 2
        if symm is not None:
            try:
                buf = symm.empty(cap * h, dtype=torch.bfloat16, device=dev)
                hdl = symm.rendezvous(buf, dist.group.WORLD.group_name)
                peer = (rank + 1) % world
                peer_view = hdl.get_buffer(peer, (cap // world, h), torch.bfloat16,
                                           storage_offset=rank * (cap // world) * h)
                src = torch.randn(cap // world, h, device=dev).to(torch.bfloat16)
                prims["symm barrier alone"] = lambda: hdl.barrier(channel=0)
                prims[f"symm P2P copy of {cap // world} rows to the peer + barrier"] = \
                    lambda: (peer_view.copy_(src), hdl.barrier(channel=0))
            except Exception as exc:  # noqa: BLE001
                lines.append(f"- symmetric memory failed: {exc!r}")
        lines += ["| primitive | us per call (16 per graph) |", "|---|---|"]
        for name, fn in prims.items():
            try:
                g = _capture(fn, reps)
                lines.append(f"| {name} | {_time_graph(g, reps):.1f} |")
                g = None
            except Exception as exc:  # noqa: BLE001
                lines.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |")
        lines += ["", f"(capacity rows exchanged per direction: {rowsb} bytes)", ""]
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            print("\n".join(lines[-60:]), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    shutdown(dev)


if __name__ == "__main__":
    main()
