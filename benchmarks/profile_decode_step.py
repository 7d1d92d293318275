"""Where a V4 decode step spends its time: kernel count and GPU time per kernel name, from a CUDA-graph replay.

Builds DeepSeek-V4-Flash dimensions with the first ``--layers`` layers (default 4: window, window, CSA, HCA;
random NVFP4 weights), prefills ``batch`` prompts, captures the decode step (with the greedy sampler) and
profiles ``--replays`` replays with torch.profiler (CUPTI sees the kernels of a graph replay). Prints, per batch
size, the kernels per step, the GPU busy time per step and the top kernels by time, so the latency of the step
can be split into launch-bound small kernels and bandwidth-bound large ones.

``--time N``: also the wall time of a whole step (host page allocation + one graph replay), the median over N steps
timed with CUDA events, without the profiler (for A/B runs of module settings, e.g. ``MEGAMOE_PDL=1``).

Usage: python benchmarks/profile_decode_step.py [--layers 4] [--batch 1,64] [--replays 10] [--time 50] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.models.config import V4_FLASH_MODEL  # noqa: E402
from megamoe.models.model import V4Model  # noqa: E402
from megamoe.models.v4_weights import random_state_dict  # noqa: E402


def random_flash_model(num_layers: int, max_batch: int, prompt_len: int, max_context: int, device) -> V4Model:
    """V4-Flash dimensions with the first ``num_layers`` layers and random NVFP4 weights (seed 0), room for
    ``max_batch`` requests of ``prompt_len`` prompt tokens and ``max_context`` tokens each."""
    cfg = V4_FLASH_MODEL
    model = V4Model(cfg, num_layers=num_layers, max_batch=max_batch, max_prefill_tokens=prompt_len,
                    max_slots=max_batch, max_context=max_context, device=device)
    for i, layer in enumerate(model.layers):
        layer.load_weights(random_state_dict(cfg, seed=0, device=device, layers=[i]))
    model.load_weights_top(random_state_dict(cfg, seed=0, device=device, layers=[]))
    return model


def prefill_random(model: V4Model, batch: int, prompt_len: int, gen: torch.Generator) -> list:
    """Prefill slots 0..batch-1 with random prompts of ``prompt_len`` tokens; returns each slot's greedy first token."""
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), generator=gen).to(model.device)
    return [int(torch.argmax(model.prefill(s, prompts[s]))) for s in range(batch)]


def step_us(step, slots) -> float:
    """Wall time of one whole decode step (host step + one replay) in us, CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step(slots)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--time", type=int, default=0, help="also time N whole steps (median, CUDA events)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    cfg = V4_FLASH_MODEL
    model = random_flash_model(args.layers, max(batches), args.prompt_len, args.prompt_len + 4 * args.replays
                               + args.time + 8, dev)
    env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MEGAMOE_") and k != "MEGAMOE_PEERS")
    lines = [f"{datetime.datetime.now().isoformat(timespec='seconds')} | {torch.cuda.get_device_name()} | "
             f"torch {torch.__version__} | layers {args.layers} ({cfg.compress_ratios[:args.layers]}) | "
             f"`{env + ' ' if env else ''}python {' '.join(sys.argv)}`"]
    gen = torch.Generator().manual_seed(0)
    for B in batches:
        first = prefill_random(model, B, args.prompt_len, gen)
        step = model.capture_decode(B)
        step.tokens.copy_(torch.tensor(first, dtype=torch.int64))
        for _ in range(3):
            step(list(range(B)))
        torch.cuda.synchronize()
        median_us = None
        if args.time:
            times = [step_us(step, list(range(B))) for _ in range(args.time)]
            median_us = sorted(times)[len(times) // 2]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                step(list(range(B)))
            torch.cuda.synchronize()
        stats = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                s = stats[ev.name[:90]]
                s[0] += 1
                s[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        n = sum(v[0] for v in stats.values()) / args.replays
        busy = sum(v[1] for v in stats.values()) / args.replays
        lines.append(f"\n## batch {B}: {n:.0f} kernels per step, GPU busy {busy:.0f} us per step "
                     f"({busy / args.layers:.0f} us per layer incl. embed/head share)"
                     + (f"; step {median_us:.1f} us (median of {args.time})" if median_us is not None else "") + "\n")
        lines.append("| kernel | per step | us per step | us each |")
        lines.append("|---|---|---|---|")
        for name, (c, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:args.top]:
            lines.append(f"| `{name}` | {c / args.replays:.1f} | {t / args.replays:.1f} | {t / c:.2f} |")
        for slot in range(B):
            model.leave(slot)
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_decode_step{'_' + args.tag if args.tag else ''}.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
