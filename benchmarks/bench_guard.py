"""Cost of the device-side index guard (issue 12) in the MoE layer: Nvfp4MoE with the guard on vs compiled out.

The guard: every kernel that takes device-valued indices (dispatch ``topk_ids``, grouped-GEMM ``row_index``,
combine ``inv_perm``) masks out-of-range values and ORs a flag into the device error word
(``megamoe/ops/errors.py``). ``MEGAMOE_DEVICE_GUARD=0`` (a benchmarking switch, read once at import) compiles
the masking and the flag code out of those kernels. Each setting runs in its own subprocess (the switch is a
compile-time constant, and a fresh process has a fresh Triton cache key); the two settings alternate for
``--rounds`` rounds so that clock drift hits both alike.

Per process: the V4-Flash preset with random weights (seed 0, w4a16, as ``benchmarks/bench_moe.py``), one CUDA
graph per token count, ``triton.testing.do_bench`` median of graph replays (inputs rotate over 4 random
batches, copied into the static input, like bench_moe). The eager layer's error check is not in the graph, so
only the kernels' guard is measured. The outputs of both settings for the same input are compared bit for bit.

Usage: python benchmarks/bench_guard.py [--tokens 1,64] [--rounds 2] [--out-dir benchmarks/results]
Writes ``guard_cost.md`` and ``guard_cost.json`` (date, device, versions, command). About 1-2 minutes on an H100.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout


def child(tokens: list[int], config_name: str) -> dict:
    """One setting (the environment's MEGAMOE_DEVICE_GUARD): graph-replay medians per token count."""
    import torch
    import triton.testing

    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS
    from megamoe.ops import errors

    config = PRESETS[config_name]
    layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=max(tokens), device="cuda")
    out = {"guard": errors.DEVICE_GUARD, "rows": {}}
    for t in tokens:
        gen = torch.Generator(device="cuda").manual_seed(1234 + t)
        xs = [torch.randn(t, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4)]
        run = layer.capture(t)
        counter = [0]

        def replay():
            counter[0] = (counter[0] + 1) % len(xs)
            run(xs[counter[0]])

        ms = triton.testing.do_bench(replay, warmup=25, rep=300, quantiles=[0.5, 0.2, 0.8])
        y = run(xs[0]).clone()
        torch.cuda.synchronize()
        errors.check_errors("cuda")  # valid inputs: nothing was flagged
        digest = hashlib.sha256(y.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
        out["rows"][str(t)] = {"median_us": ms[0] * 1e3, "p20_us": ms[1] * 1e3, "p80_us": ms[2] * 1e3,
                               "output_sha256_16": digest}
        del run
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", default="v4-flash")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        print("RESULT " + json.dumps(child(tokens, args.config)), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_guard: needs a CUDA GPU")
        return 2
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    runs = {"on": [], "off": []}
    for r in range(args.rounds):
        for setting in ("on", "off"):
            env = dict(os.environ, MEGAMOE_DEVICE_GUARD="1" if setting == "on" else "0")
            env.pop("TRITON_INTERPRET", None)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--tokens", args.tokens,
                                   "--config", args.config], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
                print(f"bench_guard: the guard-{setting} process failed (rc {proc.returncode})")
                return 1
            result = json.loads(lines[-1][len("RESULT "):])
            if result["guard"] != (setting == "on"):
                print(f"bench_guard: MEGAMOE_DEVICE_GUARD did not take effect in the guard-{setting} process")
                return 1
            runs[setting].append(result["rows"])
            print(f"round {r + 1} guard {setting}: " + ", ".join(
                f"{t} tok {row['median_us']:.1f} us" for t, row in result["rows"].items()), flush=True)

    rows = []
    for t in tokens:
        on = [run[str(t)]["median_us"] for run in runs["on"]]
        off = [run[str(t)]["median_us"] for run in runs["off"]]
        digests = {run[str(t)]["output_sha256_16"] for setting in runs.values() for run in setting}
        on_us, off_us = statistics.median(on), statistics.median(off)
        rows.append({"tokens": t, "guard_on_us": on_us, "guard_off_us": off_us,
                     "cost_pct": 100.0 * (on_us - off_us) / off_us, "on_runs_us": on, "off_runs_us": off,
                     "outputs_identical": len(digests) == 1})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "command": command, "config": args.config,
            "rounds": args.rounds}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "guard_cost.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# Device index guard cost: Nvfp4MoE layer, guard on vs compiled out (MEGAMOE_DEVICE_GUARD=0)", "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{command}`",
        f"- {args.config} preset, random weights (seed 0), w4a16; CUDA-graph replay, do_bench median per process, "
        f"median over {args.rounds} alternating processes per setting; done-when bound: < 2%", "",
        "| tokens | guard on us | guard off us | cost | runs on (us) | runs off (us) | outputs identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['guard_on_us']:.2f} | {r['guard_off_us']:.2f} | {r['cost_pct']:+.2f}% | "
                     f"{', '.join(f'{v:.1f}' for v in r['on_runs_us'])} | "
                     f"{', '.join(f'{v:.1f}' for v in r['off_runs_us'])} | {r['outputs_identical']} |")
    with open(os.path.join(args.out_dir, "guard_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
