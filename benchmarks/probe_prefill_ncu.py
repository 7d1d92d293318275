"""Nsight Compute look at the prefill expert GEMMs (issue 10): where our banded route loses to the peer at 4096
tokens (results/gpu_check_v16: 5026 vs 3197 us; fewer instructions per weight did not become time).

V4-Flash (or ``--config``) experts as bench_peer.py draws them (random NVFP4 codes; the peer's MXFP4 copy of the same values),
one top-6 routing (``--routing``, default uniform) of ``--tokens`` tokens; runs ours (gate_up + SwiGLU, down, combine) and then the
peer's two ``matmul_ogs`` calls ``--calls`` times each, eagerly. Profile the last call of each kernel with

    ncu --kernel-name regex:'nvfp4_wgmma|nvfp4_mma_decode|matmul_ogs' --launch-count 12 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
        python benchmarks/probe_prefill_ncu.py --tokens 4096 --calls 1 > "$OUT/prefill_ncu.csv"

and compare per kernel: issue-slot utilisation, the top warp stall reasons (long scoreboard = waiting on global
loads, barrier, MIO throttle = shared memory / ldmatrix, math pipe throttle), achieved occupancy and DRAM
throughput. With ``--no-peer`` or no peer found ($MEGAMOE_PEERS, ../shared/peers), ours alone runs. ncu flushes
the caches before each launch.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--routing", default="uniform", help="bench_moe_skew.py's routings (uniform, zipf, ...)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--config", default="v4-flash", help="a preset of megamoe.models.config.PRESETS")
    args = p.parse_args()
    import bench_peer as bp
    from megamoe.models.config import PRESETS

    c, dev = PRESETS[args.config], torch.device("cuda")
    w13k, w2 = bp.build_ours(c, 0, dev)
    gen = torch.Generator().manual_seed(0)
    weights, ids = (v.to(dev) for v in bp.routing(args.routing, args.tokens, c.num_experts, c.top_k, gen))
    x = torch.randn(args.tokens, c.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
    gemms, _, _ = bp.ours_forward_fns(c, w13k, w2, ids, weights, None)
    for _ in range(args.calls):
        gemms(x)
    torch.cuda.synchronize()
    print(f"ours: {args.tokens} tokens, {args.calls} calls", flush=True)
    tk, where = (None, "--no-peer") if args.no_peer else bp.load_peer()
    if tk is None:
        print(f"peer: not run ({where})", flush=True)
        return
    pw1, pc1 = bp.build_peer_weights(tk, w13k)
    pw2, pc2 = bp.build_peer_weights(tk, w2)
    rd, gi, si = bp.peer_routing_objects(tk, ids, weights, c.num_experts)
    peer = bp.peer_forward_fn(tk, pw1, pc1, pw2, pc2, rd, gi, si, c.swiglu_limit)
    for _ in range(args.calls):
        peer(x)
    torch.cuda.synchronize()
    print(f"peer: {args.tokens} tokens, {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
