"""Multi-process harness for the expert-parallel tests (CPU, gloo, 127.0.0.1 only) and the rank programs.

:func:`launch` spawns ``world`` processes (torch.multiprocessing, spawn), each joins a gloo group on a free
127.0.0.1 port with a short timeout, runs ``fn(rank, world, **kwargs)`` and saves its return value; a rank
that raises or a run past the deadline fails the test (the processes are killed; nothing hangs).

The ranks run the CPU reference path (``TRITON_INTERPRET=0``) with one thread each: MKL's float32 matmul
gives every row the same result whatever the number of rows only from enough rows (fewer rows take other kernels):
4 on AVX2; on AVX-512 (MKL 2024.2, measured 2026-11-27) 2 / 3 / 6 / 11 / 16 rows for K = 32 / 64 / 128 / 256 / >= 512.
The matmuls whose rows the ranks split are the MoE block's (router, shared expert: K = hidden 128 or the shared
width 64 in the tiny model), so the single-process oracle and the EP ranks see row-identical matmuls when each rank
has 0 or >= :data:`MIN_ROWS_PER_RANK` tokens (the routed experts' segments are identical by construction).
Elementwise ops must not depend on a row's
position either: ATen's CPU float32 softplus / sigmoid round a tensor's vectorised body and its scalar tail
differently, which made ~3% of the random seeds route a prefill's last token differently on one rank until the
router scored in float64 (``megamoe.reference.moe.score_function``); the expert MLPs' rows (I = 64 floats) are
whole vectors on AVX2 and AVX-512.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe.models import MoEConfig

TINY = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, shared_intermediate_size=32,
                 scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="tiny-ep")
GROUP_TIMEOUT_S = 20.0
#: Tokens per rank in the bit-for-bit tests (module docstring: >= 6 rows at K = 128 on AVX-512, with a margin).
MIN_ROWS_PER_RANK = 8


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, kwargs: dict, outdir: str, interpret: bool) -> None:
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    backend = kwargs.pop("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S * (6 if backend == "nccl" else 1)))
    try:
        result = fn(rank, world, **kwargs)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def launch(world: int, fn, outdir, *, timeout_s: float = 60.0, interpret: bool = False, **kwargs) -> list:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` spawned ranks; returns their results in rank order."""
    outdir = os.fspath(outdir)
    os.makedirs(outdir, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, kwargs, outdir, interpret), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"EP test ranks still running after {timeout_s} s (hang?)")
    except Exception as error:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        errs = [open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir)) if f.endswith(".err")]
        raise AssertionError(f"{error}\n" + "\n".join(errs)) from None
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ----------------------------------------------------------------------------- rank programs
def _tokens_per_rank(world: int) -> list:
    return {1: [6], 2: [6, 4], 4: [5, 7, 0, 4]}[world]


def _batch(world: int, seed: int, hidden: int, vocab: int | None = None):
    counts = _tokens_per_rank(world)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (sum(counts),), generator=gen) if vocab else None
    return counts, x, ids


def _mine(t: torch.Tensor | None, counts: list, rank: int):
    if t is None:
        return None
    start = sum(counts[:rank])
    return t[start:start + counts[rank]]


def _bias_towards_rank(c, world: int, rank: int) -> torch.Tensor:
    """A correction bias that routes every token's k experts to ``rank``'s experts (the others receive nothing)."""
    el = c.num_experts // world
    bias = torch.zeros(c.num_experts)
    bias[rank * el:(rank + 1) * el] = 100.0
    return bias


def compare_with_single_process(rank: int, world: int, *, seed: int, fuse_max: int, hash_vocab=None,
                                mode="w4a16", bias_to_rank: int | None = None) -> dict:
    """EP forward (exact and capacity) vs Nvfp4MoE on the concatenated batch; returns equality flags."""
    from megamoe.distributed import ExpertParallelMoE
    from megamoe.layers import Nvfp4MoE

    c = TINY
    counts, x, ids = _batch(world, seed + 1, c.hidden_size, hash_vocab)
    single = Nvfp4MoE.random(c, seed=seed, hash_vocab=hash_vocab, max_num_tokens=sum(counts), mode=mode,
                             fuse_shared_max_tokens=fuse_max)
    ep = ExpertParallelMoE.random(c, seed=seed, hash_vocab=hash_vocab, max_num_tokens=8, mode=mode,
                                  fuse_shared_max_tokens=fuse_max)
    if bias_to_rank is not None:  # every token's k experts on one rank: the other ranks receive nothing
        single.correction_bias = ep.correction_bias = _bias_towards_rank(c, world, bias_to_rank)
    ref = single.forward(x, ids).clone()
    ref_ids = single.last_routing[1].clone()
    mx, mids = _mine(x, counts, rank), _mine(ids, counts, rank)
    exact = ep.forward(mx, mids).clone()
    ep_ids = ep.last_routing[1].clone()
    cap = ep.forward(mx, mids, capacity=True).clone()
    want = _mine(ref, counts, rank)
    return {
        "tokens": counts[rank],
        "routing_equal": torch.equal(ep_ids, _mine(ref_ids, counts, rank)),
        "exact_equal": torch.equal(exact, want),
        "capacity_equal": torch.equal(cap, want),
        "capacity_vs_exact": torch.equal(cap, exact),
        "max_diff": (exact.float() - want.float()).abs().max().item() if counts[rank] else 0.0,
        "finite": bool(torch.isfinite(exact).all()),
        "experts_used": sorted(set(ref_ids.flatten().tolist())),
        "ref_nonzero": bool(want.abs().sum() > 0) if counts[rank] else True,
    }


def exchange_kernels_vs_oracles(rank: int, world: int, *, seed: int) -> dict:
    """Launched with ``interpret=True``: the EP layer with the exchange-planning kernels (interpreter) against the
    same layer with ``megamoe/reference/ep_exchange.py`` in their place; every other op is the same, so the outputs
    must be equal bit for bit. Scenarios: shared expert fused (last) and first, and every pair on the last rank."""
    from megamoe.distributed import ExpertParallelMoE
    from megamoe.distributed import ep_moe
    from megamoe.kernels import ep_exchange as kernels
    from megamoe.reference import ep_exchange as oracles

    c = TINY
    counts, x, _ = _batch(world, seed + 1, c.hidden_size)
    mx = _mine(x, counts, rank)
    out = {"tokens": counts[rank]}
    for name, fuse_max, bias_rank in (("fused", 64, None), ("shared_first", 0, None), ("last_rank", 64, world - 1)):
        ep = ExpertParallelMoE.random(c, seed=seed, max_num_tokens=8, fuse_shared_max_tokens=fuse_max)
        if bias_rank is not None:
            ep.correction_bias = _bias_towards_rank(c, world, bias_rank)
        results = {}
        for impl_name, impl in (("kernels", kernels), ("oracles", oracles)):
            ep_moe._exchange_impl = lambda t, impl=impl: impl
            results[impl_name] = (ep.forward(mx).clone(), ep.forward(mx, capacity=True).clone())
        out[name] = {"exact_equal": torch.equal(results["kernels"][0], results["oracles"][0]),
                     "capacity_equal": torch.equal(results["kernels"][1], results["oracles"][1]),
                     "nonzero": bool(results["kernels"][0].abs().sum() > 0) if counts[rank] else True}
    return out


def config_mismatch(rank: int, world: int, *, what: str) -> dict:
    """Ranks disagree on a setting: every rank must raise a clear ValueError (no hang)."""
    from megamoe.distributed import ExpertParallelMoE

    c = TINY
    kwargs = {"max_num_tokens": 8}
    if what == "top_k" and rank == world - 1:
        c = c.replace(top_k=3)
    elif what == "mode" and rank == 0:
        kwargs["mode"] = "w4a4"
    elif what == "divisible":
        c = c.replace(num_experts=5)
    elif what == "p2p_on_cpu":  # every rank asks for peer-to-peer stores, which gloo / CPU ranks cannot do
        kwargs["exchange"] = "p2p"
    elif what == "bad_exchange" and rank == 0:
        kwargs["exchange"] = "nvlink"
    elif what == "local_error" and rank == 1:
        kwargs["max_num_tokens"] = 0
    try:
        if what == "weights":
            ExpertParallelMoE.random(c, seed=rank, **kwargs)
        else:
            ExpertParallelMoE(c, **kwargs)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def load_from_checkpoint(rank: int, world: int, *, path: str, seed: int, fuse_max: int) -> dict:
    """Each rank loads its experts from a sharded ModelOpt checkpoint; records the tensor names it read."""
    from megamoe.checkpoint import ShardedCheckpoint, load_moe_layer
    from megamoe.distributed import load_expert_parallel_moe

    class Recording(ShardedCheckpoint):
        def get(self, name, *args):
            self.read.add(name)
            return super().get(name, *args)

        __getitem__ = get

    c = TINY
    ckpt = Recording(path)
    ckpt.read = set()
    ep = load_expert_parallel_moe(ckpt, c, prefix="model.layers.0.mlp.", max_num_tokens=8,
                                  fuse_shared_max_tokens=fuse_max, mode="w4a4")
    counts, x, _ = _batch(world, seed, c.hidden_size)
    single = load_moe_layer(path, c, prefix="model.layers.0.mlp.", max_num_tokens=sum(counts), mode="w4a4")
    single.fuse_shared_max_tokens = fuse_max
    want = _mine(single.forward(x).clone(), counts, rank)
    mx = _mine(x, counts, rank)
    exact = ep.forward(mx).clone()
    cap = ep.forward(mx, capacity=True).clone()
    return {"read": sorted(ckpt.read), "range": (ep.expert_start, ep.expert_stop),
            "static_scales": ep.input_scales is not None and single.input_scales is not None,
            "l1_equal": bool(torch.equal(ep.input_scales["l1"], single.input_scales["l1"])),
            "exact_equal": torch.equal(exact, want), "capacity_equal": torch.equal(cap, want)}


SCENARIOS = {
    "score_fused_order": dict(seed=3, fuse_max=64),
    "score_shared_first": dict(seed=4, fuse_max=0),
    "hash_routed": dict(seed=5, fuse_max=64, hash_vocab=50),
    "all_to_last_rank": dict(seed=6, fuse_max=0, bias_to_rank=-1),
    "w4a4_dynamic": dict(seed=7, fuse_max=64, mode="w4a4"),
}


def all_scenarios(rank: int, world: int, *, seed: int) -> dict:
    out = {}
    for name, kw in SCENARIOS.items():
        kw = dict(kw, seed=kw["seed"] + seed)
        if kw.get("bias_to_rank") == -1:
            kw["bias_to_rank"] = world - 1
        out[name] = compare_with_single_process(rank, world, **kw)
    return out


def loading_and_validation(rank: int, world: int, *, path: str, seed: int) -> dict:
    out = {"checkpoint": load_from_checkpoint(rank, world, path=path, seed=seed, fuse_max=64)}
    for what in ("top_k", "mode", "divisible", "local_error", "weights", "p2p_on_cpu", "bad_exchange"):
        out[what] = config_mismatch(rank, world, what=what)
    return out


def cuda_checks(rank: int, world: int, *, preset: str, tokens: int, seed: int) -> dict:
    """NCCL: EP vs one-GPU Nvfp4MoE (same weights), capacity graph replay == eager, no syncs in capacity mode."""
    from megamoe.distributed import ExpertParallelMoE
    from megamoe.layers import Nvfp4MoE
    from megamoe.models.config import PRESETS

    c, dev = PRESETS[preset], torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x_all = torch.randn(world * tokens, c.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
    x = x_all[rank * tokens:(rank + 1) * tokens].contiguous()
    ep = ExpertParallelMoE.random(c, seed=seed, max_num_tokens=tokens, device=dev)  # exchange "auto"
    exact = ep.forward(x).clone()
    cap = ep.forward(x, capacity=True).clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ep.forward(x, capacity=True)
        synced = False
    except RuntimeError:
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    replay = ep.capture(tokens)
    graph = replay(x).clone()
    # a second input, replayed back to back with the first (the workspaces are reused across steps)
    x2 = torch.randn(tokens, c.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
    graphs2 = [replay(xi).clone() for xi in (x2, x, x2)]
    eager2 = ep.forward(x2, capacity=True).clone()
    nccl = ExpertParallelMoE.random(c, seed=seed, max_num_tokens=tokens, device=dev, exchange="nccl")
    cap_nccl = nccl.forward(x, capacity=True).clone()
    nccl = None
    single = Nvfp4MoE.random(c, seed=seed, max_num_tokens=world * tokens, device=dev)
    single.fuse_shared_max_tokens = ep.fuse_shared_max_tokens
    want = single.forward(x_all)[rank * tokens:(rank + 1) * tokens].float()
    rel = ((exact.float() - want).norm() / want.norm()).item()
    ref = single.reference_forward(x_all)[rank * tokens:(rank + 1) * tokens]
    rel_ref = ((exact.float() - ref).norm() / ref.norm()).item()
    cap_rel = ((cap.float() - exact.float()).norm() / exact.float().norm()).item()
    return {"capacity_vs_exact": torch.equal(cap, exact), "capacity_rel_vs_exact": cap_rel,
            "graph_vs_eager": torch.equal(graph, cap),
            "graph_steps_vs_eager": all(torch.equal(g, want) for g, want in zip(graphs2, (eager2, cap, eager2))),
            "exchange": ep.exchange, "exchange_vs_nccl": torch.equal(cap, cap_nccl),
            "synced": synced, "rel_vs_single_gpu": rel, "bit_equal_single_gpu": torch.equal(exact.float(), want),
            "rel_vs_reference": rel_ref}


def generate_tokens(rank: int, world: int, *, seed: int, batch: int, prompt_len: int, steps: int,
                    single: bool, device: str = "cpu") -> dict:
    """Greedy prefill + decode of the tiny V4 model with expert parallelism (and, with ``single``, the
    single-process model on the same seed in this rank, after the EP run): tokens and last logits."""
    from megamoe.kvcache import DecodeBatch
    from megamoe.models.config import MODEL_PRESETS
    from megamoe.models.model import V4Model
    from megamoe.models.v4_weights import random_state_dict

    cfg = MODEL_PRESETS["tiny"]
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)

    def run(group) -> dict:
        model = V4Model(cfg, max_batch=batch, max_prefill_tokens=prompt_len, max_slots=batch,
                        max_context=prompt_len + steps + 1, ep_group=group, device=device)
        for i, layer in enumerate(model.layers):
            layer.load_weights(random_state_dict(model.cfg, seed=seed, layers=[i]))
        model.load_weights_top(random_state_dict(model.cfg, seed=seed, layers=[]))
        prefill_logits = torch.stack([model.prefill(s, prompts[s].to(device)) for s in range(batch)])
        tokens = prefill_logits.argmax(-1)
        seen, d = [tokens], DecodeBatch.allocate(batch, device)
        for _ in range(steps):
            model.prepare_decode(d, list(range(batch)))
            logits = model.decode(d, tokens)
            tokens = logits.argmax(-1)
            seen.append(tokens)
        experts = [(l.moe.expert_start, l.moe.expert_stop) if group is not None else None for l in model.layers]
        return {"tokens": torch.stack(seen).cpu(), "prefill_logits": prefill_logits.cpu(), "logits": logits.cpu(),
                "experts": experts, "hashed": [l.hashed for l in model.layers]}

    out = {"ep": run(dist.group.WORLD)}
    if single:
        out["single"] = run(None)
    return out


def load_model_from_checkpoint(rank: int, world: int, *, path: str, prompt_len: int) -> dict:
    """Build the tiny V4 model with expert parallelism from a sharded checkpoint (recording the tensor names
    this rank reads) and, in the same rank, the single-process model from the same files: prefill logits."""
    from megamoe.checkpoint.sharded import ShardedCheckpoint
    from megamoe.models.config import MODEL_PRESETS
    from megamoe.models.model import V4Model

    class Recording(ShardedCheckpoint):
        def __init__(self, p):
            super().__init__(p)
            self.read = set()

        def get(self, name, *args):
            self.read.add(name)
            return super().get(name, *args)

        __getitem__ = get

        def get_many(self, prefix):
            out = super().get_many(prefix)
            self.read.update(out)
            return out

    cfg = MODEL_PRESETS["tiny"]
    prompt = torch.arange(prompt_len, dtype=torch.int64) % cfg.vocab_size
    logits = {}
    for name, group in (("ep", dist.group.WORLD), ("single", None)):
        model = V4Model(cfg, max_batch=1, max_prefill_tokens=prompt_len, max_context=prompt_len + 1, ep_group=group)
        ckpt = Recording(path)
        model.load_weights(ckpt)
        logits[name] = model.prefill(0, prompt)
        if name == "ep":
            read = sorted(ckpt.read)
            ranges = [(l.moe.expert_start, l.moe.expert_stop) for l in model.layers]
    return {"read": read, "ranges": ranges, "equal": bool(torch.equal(logits["ep"], logits["single"]))}
