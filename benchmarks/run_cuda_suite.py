"""Run every CUDA-marked test (``pytest -m cuda``) at once, sharded over the GPUs and processes of one machine.

Usage (on a GPU machine, from the repository root):
    python benchmarks/run_cuda_suite.py --procs-per-gpu 4 --timeout 520 --out "$OUT"

The test ids are collected once and cut into contiguous shards in collection order, so tests of one file (which
share compiled kernels) mostly stay in one process; the Triton cache is shared on disk. Shard ``s`` runs on GPU
``s % num_gpus``, except one last shard of the tests matching ``--all-gpus`` (default: ``tests/distributed/``, the
expert-parallel tests of world 2 / 4), which sees every GPU. Each shard has its own wall-clock limit; a shard that
runs out reports the tests it did not reach.
Writes ``summary.md`` (per shard: counts, time, failures, the tests not reached) and ``logs.txt`` (every shard's
verbose log) into ``--out``. Exit status 0 only if every test ran and none failed.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def collect(marker: str, paths: list[str]) -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", marker, *paths], capture_output=True, text=True, check=False)
    ids = [line.strip() for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected:\n{listing.stdout[-2000:]}\n{listing.stderr[-2000:]}")
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs-per-gpu", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=520.0, help="seconds per shard")
    parser.add_argument("--marker", default="cuda")
    parser.add_argument("--out", default="cuda_suite")
    parser.add_argument("--ids-from", help="a file of test ids, one per line (e.g. a summary's tests not reached)")
    parser.add_argument("--durations", type=int, default=10, help="pytest --durations per shard")
    parser.add_argument("--alone", help="a regex: each matching test id gets a shard of its own (slow tests)")
    parser.add_argument("--all-gpus", default=r"^tests/distributed/",
                        help="a regex: matching test ids run in one shard that sees every GPU (multi-GPU tests)")
    parser.add_argument("paths", nargs="*", default=["tests"])
    args = parser.parse_args()

    import torch
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        raise SystemExit("no CUDA device")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ids_from:
        ids = [line.strip() for line in open(args.ids_from) if "::" in line]
    else:
        ids = collect(args.marker, args.paths)
    every_gpu = [i for i in ids if args.all_gpus and re.search(args.all_gpus, i)]
    alone = [i for i in ids if i not in every_gpu and args.alone and re.search(args.alone, i)]
    rest = [i for i in ids if i not in alone and i not in every_gpu]
    num_shards = max(1, min(len(rest), num_gpus * args.procs_per_gpu - len(alone) - bool(every_gpu)))
    bounds = [len(rest) * s // num_shards for s in range(num_shards + 1)]
    shards = [[i] for i in alone] + [rest[bounds[s]:bounds[s + 1]] for s in range(num_shards)]
    shards = [shard for shard in shards if shard] + ([every_gpu] if every_gpu else [])
    num_shards = len(shards)
    # the GPU each shard sees (CUDA_VISIBLE_DEVICES); None: every GPU (the multi-GPU shard, last)
    visible = [str(s % num_gpus) for s in range(num_shards - bool(every_gpu))] + ([None] if every_gpu else [])

    start = time.time()
    running = []
    for s, shard in enumerate(shards):
        log = open(out / f"shard{s}.log", "w")
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible[s] is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible[s]
        command = [sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider",
                   f"--durations={args.durations}", *shard]
        running.append((s, shard, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)))

    rows, all_ok = [], True
    for s, shard, log, proc in running:
        try:
            proc.wait(timeout=max(1.0, args.timeout - (time.time() - start)))
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        log.close()
        text = (out / f"shard{s}.log").read_text(errors="replace")
        (out / f"shard{s}.log").unlink()
        outcomes = dict(m.groups() for m in map(OUTCOME.match, text.splitlines()) if m)
        counts = {k: sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        bad = sorted(t for t, v in outcomes.items() if v in ("FAILED", "ERROR"))
        missing = [t for t in shard if t not in outcomes]
        all_ok &= not bad and not missing and proc.returncode in (0, 5) and not timed_out
        rows.append((s, len(shard), counts, proc.returncode, timed_out, bad, missing, text))

    lines = [f"# CUDA suite (-m {args.marker}), {len(ids)} tests, {num_shards} shards on {num_gpus} GPU(s), "
             f"{time.time() - start:.0f} s", "",
             "| shard | GPU | tests | passed | failed | error | skipped | not reached | rc |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s, n, counts, rc, timed_out, bad, missing, _ in rows:
        lines.append(f"| {s} | {visible[s] or 'all'} | {n} | {counts['PASSED']} | {counts['FAILED']} | "
                     f"{counts['ERROR']} | {counts['SKIPPED']} | {len(missing)} | {rc}"
                     f"{' (timed out)' if timed_out else ''} |")
    for s, n, counts, rc, timed_out, bad, missing, _ in rows:
        for t in bad:
            lines.append(f"- shard {s} failed: `{t}`")
        for t in missing:
            lines.append(f"- shard {s} not reached: `{t}`")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    with open(out / "logs.txt", "w") as merged:
        for s, *_, text in rows:
            merged.write(f"===== shard {s} =====\n")
            merged.write(text)
    print("\n".join(lines))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
