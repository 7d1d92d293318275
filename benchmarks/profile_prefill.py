"""Where a V4 prefill spends its time: wall time and GPU time per kernel name for one prompt.

Builds DeepSeek-V4-Flash dimensions with the first ``--layers`` layers (default 4: window, window, CSA, HCA; random
NVFP4 weights), runs one warm-up prefill per prompt length (compiles, allocates), then times ``--repeats`` prefills of
a fresh request with CUDA events (the median) and profiles one with torch.profiler: the kernels by name, their count
and GPU time, so the prompt's time can be split into the MoE GEMMs, attention, projections and the small kernels.
Prefill is host-driven (no graph), so the wall time includes launch gaps; "GPU busy" is the kernels' sum.

``--host``: also where the host time goes: the host syncs of one prefill (``torch.cuda.set_sync_debug_mode("warn")``,
counted by the line that caused them) and the torch ops by CPU self time.

``--cprofile``: also one prefill under cProfile: the Python functions by own and by cumulative time.

Usage: python benchmarks/profile_prefill.py [--layers 4] [--tokens 1024,4096] [--top 30] [--host] [--cprofile]
[--out PATH.md]
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


def host_profile(model, prompt, top: int) -> list:
    """The host syncs of one prefill by source line, and the torch ops by CPU self time."""
    import traceback
    import warnings

    torch.cuda.synchronize()
    stacks = []

    def keep(message, category, filename, lineno, file=None, line=None):
        stacks.append(traceback.extract_stack()[:-2])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.prefill(0, prompt)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    model.leave(0)
    frames = collections.Counter()
    for st in stacks:
        own = [f for f in st if "/megamoe/" in f.filename]
        if own:
            f = own[-1]
            frames[f"{os.path.relpath(f.filename)}:{f.lineno} {f.line}"] += 1
    out = [f"\n### host syncs in one prefill: {len(stacks)}\n", "| where (innermost megamoe frame) | syncs |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in frames.most_common(top)] or ["| - | 0 |"]
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.prefill(0, prompt)
        torch.cuda.synchronize()
    model.leave(0)
    out += ["\n### torch ops by CPU self time (one prefill)\n", "| op | calls | self CPU us |", "|---|---|---|"]
    for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        out.append(f"| `{ev.key[:80]}` | {ev.count} | {ev.self_cpu_time_total:.0f} |")
    return out


def python_profile(model, prompt, top: int) -> list:
    """One prefill under cProfile: where the host's Python time goes (the prefill is host-bound at <= 4096 tokens:
    its wall time is 1.1-2.3x its GPU busy time). Returns markdown lines: the functions by own time and by cumulative
    time (file:line shortened to the package-relative path)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    model.prefill(0, prompt)
    torch.cuda.synchronize()
    prof.disable()
    model.leave(0)
    stats = pstats.Stats(prof)
    total = stats.total_tt * 1e6

    def where(func):
        path, line, name = func
        for marker in ("site-packages/", "megamoe/", "benchmarks/"):
            if marker in path:
                path = path[path.index(marker) + (len(marker) if marker == "site-packages/" else 0):]
                break
        return f"{path}:{line} {name}"[:100]

    out = [f"\n### Python time of one prefill (cProfile, {total:.0f} us in all, profiler overhead included)\n"]
    for key, label in (("tottime", "own"), ("cumtime", "cumulative")):
        rows = sorted(stats.stats.items(), key=lambda kv: -(kv[1][2] if key == "tottime" else kv[1][3]))[:top]
        out += [f"\n#### by {label} time\n", "| function | calls | own us | cumulative us |", "|---|---|---|---|"]
        for func, (cc, nc, tt, ct, _) in rows:
            out.append(f"| `{where(func)}` | {nc} | {tt * 1e6:.0f} | {ct * 1e6:.0f} |")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="also one prefill under cProfile (python_profile)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lengths = [int(t) for t in args.tokens.split(",")]
    cfg = V4_FLASH_MODEL
    model = V4Model(cfg, num_layers=args.layers, max_batch=1, max_prefill_tokens=max(lengths), max_slots=1,
                    max_context=max(lengths) + 8, device=dev)
    for i, layer in enumerate(model.layers):
        layer.load_weights(random_state_dict(cfg, seed=0, device=dev, layers=[i]))
    model.load_weights_top(random_state_dict(cfg, seed=0, device=dev, layers=[]))
    lines = [f"# V4 prefill profile\n\n- {datetime.datetime.now().isoformat(timespec='seconds')} | "
             f"{torch.cuda.get_device_name()} | torch {torch.__version__} | layers {args.layers} "
             f"({cfg.compress_ratios[:args.layers]}) | `python benchmarks/profile_prefill.py --layers {args.layers} "
             f"--tokens {args.tokens}`"]
    gen = torch.Generator().manual_seed(0)
    for T in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (T,), generator=gen).to(dev)
        model.prefill(0, prompt)  # warm-up: compiles and allocates
        model.leave(0)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            model.prefill(0, prompt)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
            model.leave(0)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.prefill(0, prompt)
            torch.cuda.synchronize()
        model.leave(0)
        stats = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                st = stats[ev.name[:90]]
                st[0] += 1
                st[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        busy = sum(v[1] for v in stats.values())
        wall = sorted(times)[len(times) // 2]
        lines.append(f"\n## {T} tokens: wall {wall:.0f} us (median of {args.repeats}), {sum(v[0] for v in stats.values())}"
                     f" kernels, GPU busy {busy:.0f} us ({busy / args.layers:.0f} us per layer incl. embed/head share)\n")
        lines.append("| kernel | count | us | us each | % of busy |")
        lines.append("|---|---|---|---|---|")
        for name, (c, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:args.top]:
            lines.append(f"| `{name}` | {c} | {t:.1f} | {t / c:.2f} | {100 * t / busy:.1f}% |")
        print("\n".join(lines[-args.top - 4:]), flush=True)
        if args.host:
            lines += host_profile(model, prompt, args.top)
            print("\n".join(lines[-args.top - 12:]), flush=True)
        if args.cprofile:
            lines += python_profile(model, prompt, args.top)
            print("\n".join(lines[-2 * args.top - 8:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
