"""PDL (programmatic dependent launch) off vs on for the MoE layer's decode kernels (issue 11).

The fused route + dispatch, the mma.sync decode GEMMs and the combine take ``megamoe.kernels.pdl``'s switch at
every launch, so one process times both settings: capture the layer with ``PDL_ENABLED`` off, time the replay,
capture again with it on, time, and compare the outputs bit for bit. CUDA-graph replay (the layer's
``capture``), do_bench medians over rotating inputs; the two settings alternate over ``--rounds``.

Usage: python benchmarks/bench_pdl.py [--configs v4-flash] [--tokens 1,8] [--rounds 2] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    import torch
    import triton
    import triton.testing

    from megamoe.kernels import pdl
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "pdl_v1"))
    args = ap.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    rows = []
    for name in args.configs.split(","):
        config = PRESETS[name]
        layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=max(tokens), device="cuda")
        for t in tokens:
            gen = torch.Generator(device="cuda").manual_seed(1234 + t)
            xs = [torch.randn(t, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(4)]
            times = {False: [], True: []}
            outs = {}
            for _ in range(args.rounds):
                for setting in (False, True):
                    pdl.PDL_ENABLED = setting
                    run = layer.capture(t)
                    counter = [0]

                    def replay(run=run):
                        counter[0] = (counter[0] + 1) % len(xs)
                        run(xs[counter[0]])

                    times[setting].append(triton.testing.do_bench(replay, warmup=25, rep=200,
                                                                  return_mode="median") * 1e3)
                    outs[setting] = run(xs[0]).clone()
                    del run
            pdl.PDL_ENABLED = False
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append(dict(config=name, tokens=t, off_us=off, on_us=on, speedup=off / on,
                             identical=bool(torch.equal(outs[False], outs[True])), runs_off=times[False],
                             runs_on=times[True]))
            print(f"{name} {t} tok: PDL off {off:.1f} us, on {on:.1f} us ({off / on:.3f}x), identical "
                  f"{rows[-1]['identical']}", flush=True)
        del layer
        torch.cuda.empty_cache()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# PDL off vs on, MoE layer (graph replay)\n\n- {json.dumps(meta)}\n- kernels with PDL: fused "
                "route + dispatch, mma.sync decode GEMMs, combine; median over rounds of do_bench medians\n\n"
                "| config | tokens | PDL off us | PDL on us | speed-up | outputs identical | runs off | runs on |\n"
                "|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['config']} | {r['tokens']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['speedup']:.3f}x | "
                    f"{r['identical']} | {', '.join(f'{v:.1f}' for v in r['runs_off'])} | "
                    f"{', '.join(f'{v:.1f}' for v in r['runs_on'])} |\n")
    print("wrote", args.out + ".md")


if __name__ == "__main__":
    main()
