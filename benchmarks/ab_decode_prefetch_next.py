"""A/B of the decode band's L2 prefetch of the next GEMM's weights (issue 11; NOTES_gemm.md v26): the MoE layer.

``Nvfp4MoE.random`` (w4a16, default flags: row-interleaved weights, the mma.sync decode kernel at 1-16 tokens) per
config and token count, captured once per setting (``ops.gemm.DECODE_PREFETCH_NEXT_BYTES`` in MB and
``DECODE_PREFETCH_EVICT_LAST``; "off" = today's kernel). Each capture's replay is timed with
``triton.testing.do_bench`` (L2 cleared before every replay, median); the settings run in ``--rounds`` interleaved
rounds, so drift shows as round-to-round spread. Every capture's output must equal "off"'s bit for bit (the
prefetch moves no math); a mismatch is reported and fails the run.

Run (H100): ``python benchmarks/ab_decode_prefetch_next.py [--configs v4-flash,v4-pro] [--tokens 1,2,4,8,16]
[--settings off,16,32,32e,48e] [--rounds 2] [--out DIR] [--tag T]`` -> DIR/ab_decode_prefetch_next[_T].{md,json}
(a setting "Ne" is N MB with the evict-last hint); ``--flush read``: do_bench clears the L2 by reading
(``graph_timing.flush_mode``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _apply(setting: str) -> None:
    from megamoe.ops import gemm as gemm_ops

    if setting == "off":
        gemm_ops.DECODE_PREFETCH_NEXT_BYTES, gemm_ops.DECODE_PREFETCH_EVICT_LAST = 0, False
        return
    evict = setting.endswith("e")
    gemm_ops.DECODE_PREFETCH_NEXT_BYTES = int(float(setting.rstrip("e")) * 2 ** 20)
    gemm_ops.DECODE_PREFETCH_EVICT_LAST = evict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--settings", default="off,16,32,32e,48e")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--flush", default="write", help="how do_bench clears the L2: write (its own) or read "
                    "(graph_timing.flush_mode)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_decode_prefetch_next.py needs a CUDA GPU")
        return 0
    from graph_timing import flush_mode
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    dev = torch.device("cuda")
    tokens = [int(v) for v in args.tokens.split(",")]
    settings = args.settings.split(",")
    assert settings[0] == "off", "the first setting is the baseline (off)"
    rows, ok = [], True
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        for t in tokens:
            x = torch.randn(t, c.hidden_size, device=dev,
                            generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            graphs, outs = {}, {}
            for s in settings:
                _apply(s)
                layer(x)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = layer(x)
                g.replay()
                torch.cuda.synchronize()
                graphs[s], outs[s] = g, y.clone()
            _apply("off")
            times = {s: [] for s in settings}
            with flush_mode(args.flush):
                for _ in range(args.rounds):
                    for s in settings:
                        times[s].append(triton.testing.do_bench(graphs[s].replay, warmup=20, rep=150,
                                                                return_mode="median") * 1e3)
            base = statistics.median(times["off"])
            for s in settings:
                same = bool(torch.equal(outs[s], outs["off"]))
                ok &= same
                us = statistics.median(times[s])
                rows.append(dict(config=name, tokens=t, setting=s, us=us, rounds=times[s], speedup=base / us,
                                 same_bits=same))
                print(f"{name} T={t} {s}: {us:.1f} us ({base / us:.3f}x) rounds "
                      f"{[round(v, 1) for v in times[s]]} same bits {same}", flush=True)
            del graphs, outs
        del layer
        torch.cuda.empty_cache()
    tag = f"_{args.tag}" if args.tag else ""
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv), flush=args.flush)
    with open(os.path.join(args.out, f"ab_decode_prefetch_next{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Decode band's L2 prefetch of the down weights: MoE layer graph replay ({meta['device']})", "",
             f"- date {meta['date']}; torch {meta['torch']}; triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             "- setting: MB of next-GEMM weights prefetched over the touched experts (e = evict-last hint); do_bench "
             f"median of graph replays, L2 cleared before each by a {args.flush} flush; median over the interleaved "
             "rounds; speed-up = off / setting", "",
             "| config | tokens | setting | us | speed-up | rounds | same bits as off |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['tokens']} | {r['setting']} | {r['us']:.1f} | {r['speedup']:.3f}x | "
              f"{', '.join(f'{v:.1f}' for v in r['rounds'])} | {'yes' if r['same_bits'] else 'NO'} |" for r in rows]
    with open(os.path.join(args.out, f"ab_decode_prefetch_next{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
