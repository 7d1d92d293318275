"""``torchrun --nproc-per-node N -m megamoe run --ep``: the expert-parallel main job.

Each rank builds its share of the layer (random weights: the same as the single-process ``run``'s for the
same seed; or ``--checkpoint``: only its experts are read), runs its own ``--tokens`` tokens through the
exact and the capacity exchange, checks both against the single-process layer on the concatenated batch
(``--no-check`` skips that: it needs every expert on every rank), and times both (rank 0 prints).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32 (a host read)."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def main_ep(args) -> int:
    from ..layers.moe import Nvfp4MoE
    from ..models.config import PRESETS
    from .comm import init_from_env, shutdown
    from .ep_moe import ExpertParallelMoE
    from .loading import load_expert_parallel_moe

    device = init_from_env()
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    preset = args.config or ("v4-flash" if cuda else "small")
    if preset not in PRESETS:
        if rank == 0:
            print(f"--config: expected one of {sorted(PRESETS)}, got {preset!r}")
        return 2
    config = PRESETS[preset]
    tokens = args.tokens if args.tokens is not None else (64 if cuda else 8)
    say = print if rank == 0 else (lambda *a, **k: None)
    t0 = time.perf_counter()
    if args.checkpoint:
        layer = load_expert_parallel_moe(args.checkpoint, config, prefix=args.prefix, max_num_tokens=tokens,
                                         device=device, mode=args.mode)
    else:
        layer = ExpertParallelMoE.random(config, seed=args.seed, max_num_tokens=tokens, device=device,
                                         mode=args.mode)
    c = config
    say(f"megamoe run --ep: {c.name} (H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, "
        f"top-{c.top_k}), {world} ranks x {tokens} tokens, {layer.num_local_experts} experts per rank, "
        f"backend={dist.get_backend()}, mode={args.mode} (built in {time.perf_counter() - t0:.1f} s)")
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    x_all = torch.randn((world * tokens, c.hidden_size), generator=gen, device=device).to(torch.bfloat16)
    x = x_all[rank * tokens:(rank + 1) * tokens]
    exact = layer.forward(x).clone()
    capacity = layer.forward(x, capacity=True).clone()
    # the GEMM tiling is chosen by the receive buffer's row count, which is the exchanged rows in exact mode and
    # the fixed capacity in capacity mode: on CUDA the two may take other kernels (same math, other summation
    # order), so there they must agree to 1e-2; on CPU (one reference path) bit for bit
    cap_rel = _rel(capacity, exact)
    ok = torch.equal(exact, capacity) or (cuda and cap_rel < 1e-2)
    report = {"capacity == exact (bit for bit)": bool(torch.equal(exact, capacity)), "capacity rel diff": cap_rel}
    if not getattr(args, "no_check", False):
        if args.checkpoint:
            from ..checkpoint import load_moe_layer

            single = load_moe_layer(args.checkpoint, config, prefix=args.prefix, max_num_tokens=world * tokens,
                                    device=device, mode=args.mode)
        else:
            single = Nvfp4MoE.random(config, seed=args.seed, max_num_tokens=world * tokens, device=device,
                                     mode=args.mode)
        single.fuse_shared_max_tokens = layer.fuse_shared_max_tokens
        want = single.forward(x_all)[rank * tokens:(rank + 1) * tokens]
        diff = (exact.float() - want.float()).abs().max().item()
        rel = _rel(exact, want)
        report["== single-process (bit for bit)"] = bool(torch.equal(exact, want))
        report["max |diff|"] = diff
        report["rel diff"] = rel
        ok = ok and (torch.equal(exact, want) or (cuda and rel < 1e-2))
        del single
    flags = [None] * world
    dist.all_gather_object(flags, report)
    for r, rep in enumerate(flags):
        say(f"  rank {r}: " + ", ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}"
                                        for k, v in rep.items()))
    for mode_name, kwargs in (("exact", {}), ("capacity", {"capacity": True})):
        iters = args.iters or (20 if cuda else 3)
        for _ in range(2):
            layer.forward(x, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            layer.forward(x, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3 / iters
        say(f"  {mode_name}: {ms * 1e3:.1f} us per call (rank 0, eager, {iters} iterations)")
    all_ok = torch.tensor([int(ok)], device=device)
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    status = 0 if int(all_ok.item()) else 1
    say("ok" if status == 0 else "MISMATCH")
    shutdown(device)
    return status
