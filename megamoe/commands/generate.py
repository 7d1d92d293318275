"""``python -m megamoe generate``: the main job — prefill a prompt batch, then decode tokens.

On CUDA: DeepSeek-V4-Flash dimensions with as many layers as fit the GPU (``--layers N`` to choose), random
NVFP4 weights unless ``--checkpoint DIR`` names a ModelOpt NVFP4 checkpoint (safetensors shards + index json,
read lazily layer by layer); each decode step is one CUDA-graph replay per batch size (``--batch 1,8,64``),
with the page allocation on the host between steps. On CPU: the tiny configuration (finishes in seconds).

Prints the generated token ids, the per-token decode latency, tokens/s, a per-layer-kind breakdown (attention /
MoE / other, from one eager profiled step) and the device memory of each component.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="DeepSeek-V4 model: prefill prompts and decode tokens (main job)")
    p.add_argument("--config", default=None, help="v4-flash or tiny (default: v4-flash on GPU, tiny on CPU)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to run (default: all that fit)")
    p.add_argument("--batch", default=None, help="comma-separated decode batch sizes (default: 1,8,64 GPU; 2 CPU)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 64 GPU, 12 CPU)")
    p.add_argument("--steps", type=int, default=None, help="decode steps (default 32 GPU, 16 CPU)")
    p.add_argument("--checkpoint", default=None, help="directory of a ModelOpt NVFP4 V4 checkpoint (sharded)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ep", action="store_true",
                   help="expert parallelism over the ranks of 'torchrun --nproc-per-node N -m megamoe generate --ep' "
                        "(NCCL on GPUs, gloo on CPU): each rank holds E/N routed experts per layer, the rest is "
                        "replicated; every rank must produce the same tokens (checked)")
    p.set_defaults(func=main)


def _batch_sizes(text, default):
    if text is None:
        return default
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--batch: expected comma-separated positive ints, got {text!r}")
    if not sizes or any(s < 1 for s in sizes):
        raise SystemExit(f"--batch: expected comma-separated positive ints, got {text!r}")
    return sizes


def _layers_that_fit(cfg, device, world_size: int = 1) -> int:
    """Layers whose experts fit in ~85% of the free GPU memory next to embed/head and caches (host estimate);
    with expert parallelism over ``world_size`` ranks each rank holds 1/world_size of the routed experts."""
    from ..models.v4_weights import weight_specs

    per_layer = 0
    for spec in weight_specs(cfg.replace(num_layers=1, compress_ratios=cfg.compress_ratios[:1],
                                         num_hash_layers=min(cfg.num_hash_layers, 1))).values():
        if spec.name.startswith("layers.0."):
            n = 1
            for d in spec.shape:
                n *= d
            share = 1 / world_size if ".ffn.experts." in spec.name else 1
            per_layer += share * n * (9 / 16 if spec.kind == "nvfp4" else 2 if spec.kind == "bf16" else 4)
    free, _ = torch.cuda.mem_get_info(device)
    fixed = 2 * cfg.vocab_size * cfg.hidden_size * 2 + 8 * 2**30  # embed + head, caches, one layer being built
    return max(1, min(cfg.num_layers, int((0.85 * free - fixed) // (per_layer * 1.1))))


def main(args) -> int:
    from ..kvcache import DecodeBatch
    from ..models.config import MODEL_PRESETS
    from ..models.model import PhaseTimer, V4Model
    from ..ops.sampling import SamplingParams, sample

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    ep_group, rank, say = None, 0, print
    if getattr(args, "ep", False):
        from ..distributed.comm import init_from_env

        try:
            device = init_from_env(device.type)
        except RuntimeError as error:
            raise SystemExit(f"--ep: {error}")
        ep_group, rank = dist.group.WORLD, dist.get_rank()
        say = print if rank == 0 else (lambda *a, **k: None)
    gpu = device.type == "cuda"
    name = args.config or ("v4-flash" if gpu else "tiny")
    if name not in MODEL_PRESETS:
        raise SystemExit(f"--config: expected one of {sorted(MODEL_PRESETS)}, got {name!r}")
    cfg = MODEL_PRESETS[name]
    batches = _batch_sizes(args.batch, [1, 8, 64] if gpu else [2])
    prompt_len = args.prompt_len if args.prompt_len is not None else (64 if gpu else 12)
    steps = args.steps if args.steps is not None else (32 if gpu else 16)
    for flag, v in (("--prompt-len", prompt_len), ("--steps", steps)):
        if v < 1:
            raise SystemExit(f"{flag}: expected a positive int, got {v}")
    num_layers = args.layers
    if num_layers is None:
        world = dist.get_world_size() if ep_group is not None else 1
        num_layers = _layers_that_fit(cfg, device, world) if gpu else cfg.num_layers
    if ep_group is not None and cfg.moe.num_experts % dist.get_world_size():
        raise SystemExit(f"--ep: {cfg.moe.num_experts} routed experts do not split over {dist.get_world_size()} ranks")
    if not 1 <= num_layers <= cfg.num_layers:
        raise SystemExit(f"--layers: expected 1..{cfg.num_layers}, got {num_layers}")
    max_batch = max(batches)
    max_context = prompt_len + steps + 1
    if max_context > cfg.max_seq_len:
        raise SystemExit(f"--prompt-len + --steps: {max_context} exceeds the config's max_seq_len={cfg.max_seq_len}")

    ranks = f" x {dist.get_world_size()} ranks (expert parallel)" if ep_group is not None else ""
    say(f"model {cfg.name}: {num_layers}/{cfg.num_layers} layers on {device}{ranks}; batches {batches}, prompt "
        f"{prompt_len} tokens, {steps} decode steps")
    t0 = time.perf_counter()
    model = V4Model(cfg, num_layers=num_layers, max_batch=max_batch, max_prefill_tokens=prompt_len,
                    max_slots=max_batch, max_context=max_context, device=device, ep_group=ep_group)
    if args.checkpoint:
        from ..checkpoint.sharded import ShardedCheckpoint

        model.load_weights(ShardedCheckpoint(args.checkpoint))
    else:
        from ..models.v4_weights import random_state_dict

        for i, layer in enumerate(model.layers):  # one layer's random weights at a time (peak memory)
            layer.load_weights(random_state_dict(model.cfg, seed=args.seed, device=device, layers=[i]))
        model.load_weights_top(random_state_dict(model.cfg, seed=args.seed, device=device, layers=[]))
    say(f"weights ready in {time.perf_counter() - t0:.1f} s; memory: "
          + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in model.memory_bytes().items()))

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    for B in batches:
        prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=gen).to(device)
        first = []
        t0 = time.perf_counter()
        for slot in range(B):
            logits = model.prefill(slot, prompts[slot])
            first.append(int(torch.argmax(logits)))
        prefill_s = time.perf_counter() - t0
        outputs = [[t] for t in first]
        if gpu:
            step = model.capture_decode(B, filtering=args.top_k > 0 or args.top_p < 1.0)
            step.params.set(list(range(B)), temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
            step.tokens.copy_(torch.tensor(first, dtype=torch.int64))
            torch.cuda.synchronize()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                tokens = step(list(range(B)))
                host = tokens.tolist()  # the one host read per step: the sampled token ids
                times.append(time.perf_counter() - t)
                for r in range(B):
                    outputs[r].append(host[r])
        else:
            batch = DecodeBatch.allocate(B, device)
            params = SamplingParams.allocate(B, device)
            params.set(list(range(B)), temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed)
            tokens = torch.tensor(first, dtype=torch.int64, device=device)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                model.prepare_decode(batch, list(range(B)))
                tokens = sample(model.decode(batch, tokens), params)
                host = tokens.tolist()
                times.append(time.perf_counter() - t)
                for r in range(B):
                    outputs[r].append(host[r])
        times.sort()
        median = times[len(times) // 2]
        say(f"batch {B}: prefill {prefill_s * 1e3:.1f} ms total; decode {median * 1e3:.2f} ms/token (median of "
              f"{steps}), {B / median:.1f} tokens/s")
        # per-layer-kind breakdown: one eager profiled step (synchronizes between phases)
        pbatch = DecodeBatch.allocate(B, device)
        timer = PhaseTimer(device)
        model.prepare_decode(pbatch, list(range(B)))
        timer.start()
        model.decode(pbatch, torch.tensor([o[-1] for o in outputs], dtype=torch.int64, device=device), timer=timer)
        timer("other")
        total = sum(timer.totals.values())
        say("  eager step breakdown: " + ", ".join(f"{k} {v * 1e3:.2f} ms ({100 * v / total:.0f}%)"
                                                    for k, v in sorted(timer.totals.items())))
        say(f"  tokens of request 0: {outputs[0][:16]}{' ...' if len(outputs[0]) > 16 else ''}")
        for slot in range(B):
            model.leave(slot)
        if ep_group is not None:  # replicated layers + exact EP: every rank must have sampled the same tokens
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, outputs)
            differ = [r for r, o in enumerate(everyone) if o != everyone[0]]
            if differ:
                raise SystemExit(f"--ep: ranks {differ} generated other tokens than rank 0 (batch {B})")
            say(f"  all {len(everyone)} ranks generated the same tokens")
    if ep_group is not None:
        from ..distributed.comm import shutdown

        step = None  # noqa: F841  (the decode graphs hold captured collectives: gone before the group)
        model.release_graphs()
        shutdown(device)
    return 0
