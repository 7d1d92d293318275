"""A/B of module settings on the whole V4 decode step, in one process: one graph per setting, replays interleaved.

``profile_decode_step.py --time`` times one setting per process, and the same setting moved 5-8% between two processes
(results/gpu_check_v39 h, gpu_check_v40 b), more than the settings it was meant to compare. Here one model (V4-Flash
dimensions, the first ``--layers`` layers, random NVFP4 weights) captures one decode graph per setting (the settings
are module globals read at launch, so each graph keeps its own), then times whole steps (host page allocation + one
replay, CUDA events) in ``--rounds`` rounds; each round runs ``--steps`` steps of every setting, the settings' order
rotating from round to round. All graphs decode the same caches, one step after another.

Settings: as ``ab_layer_settings.py``'s (its namespace and its snapshot of the settings it knows, restored after each
capture): Python run before that setting's capture, e.g. ``--settings "base|pdl.PDL_ENABLED=True|pdl.PDL_LAUNCH=
pdl.PDL_LAUNCH.union({'splitk'}); pdl.PDL_EARLY_READS=pdl.PDL_EARLY_READS.union({'splitk'})"`` (``|`` between
settings, so none may contain one; ``base`` runs nothing). The namespace also holds ``model``; only the module
settings listed in ``ab_layer_settings._SAVED`` are restored after a capture, changes to ``model`` are not.

Reports per batch size and setting the median step (us) over all rounds, each round's median, and the ratio to the
first setting. Run: ``python benchmarks/ab_decode_step.py [--layers 4] [--batch 1,8] [--settings S] [--rounds 6]
[--steps 20] [--tag T] --out DIR`` -> DIR/ab_decode_step[_T].md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab_layer_settings import _namespace, _restore, _snapshot  # noqa: E402
from megamoe.models.config import V4_FLASH_MODEL  # noqa: E402
from profile_decode_step import prefill_random, random_flash_model, step_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--settings", default="base|pdl.PDL_ENABLED=True")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split("|")]
    for spec in settings:  # syntax errors before the model is built
        compile(spec, "--settings", "exec")
    dev = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    cfg = V4_FLASH_MODEL
    total_steps = args.rounds * args.steps * len(settings) + 4 * len(settings)
    model = random_flash_model(args.layers, max(batches), args.prompt_len, args.prompt_len + total_steps + 8, dev)
    ns = dict(_namespace(), model=model)
    defaults = _snapshot(ns)
    lines = [f"# Decode step A/B in one process ({datetime.datetime.now().isoformat(timespec='seconds')}, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"Command: `python {' '.join(sys.argv)}`. V4-Flash dimensions, {args.layers} layers "
             f"({cfg.compress_ratios[:args.layers]}); {args.rounds} rounds x {args.steps} steps per setting, the order "
             "rotating; us per whole step (host step + one replay, CUDA events).", ""]
    gen = torch.Generator().manual_seed(0)
    for B in batches:
        first = prefill_random(model, B, args.prompt_len, gen)
        steps = []
        for spec in settings:
            if spec != "base":
                exec(spec, ns)
            try:
                step = model.capture_decode(B)
            finally:
                _restore(ns, defaults)
            step.tokens.copy_(torch.tensor(first, dtype=torch.int64))
            steps.append(step)
        slots = list(range(B))
        for step in steps:  # warm up
            for _ in range(2):
                step(slots)
        torch.cuda.synchronize()
        times = [[] for _ in settings]
        rounds = [[] for _ in settings]
        for r in range(args.rounds):
            for j in range(len(settings)):
                s = (j + r) % len(settings)
                block = [step_us(steps[s], slots) for _ in range(args.steps)]
                times[s] += block
                rounds[s].append(statistics.median(block))
        base = statistics.median(times[0])
        lines += [f"## batch {B}", "", "| setting | median us | vs first | round medians |", "|---|---|---|---|"]
        for spec, t, rm in zip(settings, times, rounds):
            med = statistics.median(t)
            lines.append(f"| `{spec}` | {med:.1f} | {base / med:.3f}x | {' / '.join(f'{v:.0f}' for v in rm)} |")
        lines.append("")
        print("\n".join(lines[-len(settings) - 4:]), flush=True)
        for slot in range(B):
            model.leave(slot)
        model.release_graphs()
        del steps
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ab_decode_step{'_' + args.tag if args.tag else ''}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
