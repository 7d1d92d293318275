"""A/B of module settings in the MoE layer at decode sizes, one run, same-bits check (issues 10 / 11).

Each setting is Python run in a namespace holding ``gemm`` (``megamoe.ops.gemm``), ``mma``
(``megamoe.kernels.gemm.nvfp4_mma_decode``), ``pdl`` (``megamoe.kernels.pdl``), ``moe`` (``megamoe.layers.moe``),
``rd`` (``megamoe.kernels.moe_route_dispatch``), ``pipe`` (``megamoe.kernels.gemm.nvfp4_wgmma_pipe``) and
``layer`` (the layer), e.g.
``gemm.DECODE_SPLITK=None`` (planned decode split-K), ``mma.MMA_DECODE_CONFIGS[4]=(8,64,256,4)``,
``pdl.PDL_ENABLED=True``, ``moe.PAIRED_X_MAX_TOKENS=0`` or ``layer.shared_overlap=True``; "base" runs nothing. Per config and token count the layer
(``Nvfp4MoE.random``, w4a16, defaults) is captured once per setting (the setting applied before the capture, the
defaults restored after it: a graph keeps the launches it captured), then the replays are timed with
``triton.testing.do_bench`` in ``--rounds`` interleaved rounds (median), the L2 cleared before each replay by
``--flush`` (``graph_timing.flush_mode``: "read" leaves no dirty lines whose write-back the replay would pay). Every
setting's output is compared with "base"'s: settings that only move work between programs give the same bits,
others (split-K's summation order) are reported as differing, not failed.

``--routings``: "router" (default: the layer's own random router, near-uniform) and / or the forced routings of
``bench_moe_skew.py`` ("uniform", "zipf", "all-on-k": fixed (weights, ids) per token count, seeded).

Run (H100): ``python benchmarks/ab_layer_settings.py --settings "base|gemm.DECODE_SPLITK=None" [--configs
v4-flash,v4-pro] [--tokens 1,2,4,8] [--routings router,zipf] [--flush read] [--rounds 2] [--out DIR] [--tag T]``
-> DIR/ab_layer_settings[_T].{md,json}.
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

_SAVED = ("gemm.DECODE_SPLITK", "mma.MMA_DECODE_CONFIGS", "mma.INTERLEAVED_MAXNREG",
          "mma.DECODE_SPLITK_PROGRAMS_PER_SM", "mma.DECODE_SPLITK_MAX_SPLITS", "gemm.PIPE_AFTER_DECODE",
          "pdl.PDL_ENABLED", "layer.shared_overlap",
          "layer.fuse_shared_max_tokens", "mma.DECODE_ONE_WAVE", "mma.DECODE_MAXNREG",
          "mma.MMA_DECODE_ONE_WAVE_CONFIG", "mma.MMA_X_PAIRED", "moe.PAIRED_X_MIN_TOKENS",
          "moe.PAIRED_X_MAX_TOKENS", "gemm.ONE_EXPERT_SPLITK_MAX_ROWS", "moe.SHARED_SPLITK",
          "gemm.PIPE_ABOVE_MMA_ROWS", "gemm.PIPE_ABOVE_WIDE_N", "pdl.PDL_PROLOGUE", "pdl.PDL_LAUNCH",
          "pdl.PDL_EARLY_READS", "rd.SMALL_T_BLOCK_E", "gemm.BANDS_OVERLAP", "moe.SHARED_OVERLAP_SPLITK",
          "pipe.PIPE_BAND_CONFIGS", "pipe.PIPE_BAND64_NARROW_CONFIG")


def _namespace():
    from megamoe.kernels import moe_route_dispatch as rd
    from megamoe.kernels import pdl
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe
    from megamoe.layers import moe
    from megamoe.ops import gemm

    return dict(gemm=gemm, mma=mma, pdl=pdl, moe=moe, rd=rd, pipe=pipe)


def _snapshot(ns):
    """The values of :data:`_SAVED` whose module name is in ``ns`` (``layer`` only where a script has one)."""
    out = {}
    for name in _SAVED:
        mod, attr = name.split(".")
        if mod not in ns:
            continue
        value = getattr(ns[mod], attr)
        out[name] = dict(value) if isinstance(value, dict) else value
    return out


def _restore(ns, saved):
    """Back to the snapshot; dicts in place (other modules may hold the same dict object)."""
    for name, value in saved.items():
        mod, attr = name.split(".")
        current = getattr(ns[mod], attr)
        if isinstance(value, dict) and isinstance(current, dict):
            current.clear()
            current.update(value)
        else:
            setattr(ns[mod], attr, value)


def main(argv=None) -> int:
    from graph_timing import add_flush_argument, flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", required=True, help='"|"-separated; the first is the baseline, e.g. "base|..."')
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="1,2,4,8")
    add_flush_argument(ap, default="read")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--routings", default="router", help="router and / or uniform, zipf, all-on-k (bench_moe_skew)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_layer_settings.py needs a CUDA GPU")
        return 0
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    ns = _namespace()
    dev = torch.device("cuda")
    tokens = [int(v) for v in args.tokens.split(",")]
    settings = args.settings.split("|")
    routings = args.routings.split(",")
    rows = []
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        ns["layer"] = layer
        defaults = _snapshot(ns)
        for t, kind in [(t, kind) for t in tokens for kind in routings]:
            x = torch.randn(t, c.hidden_size, device=dev,
                            generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            if kind != "router":
                from bench_moe_skew import _force_routing, routing

                w, ids = routing(kind, t, c.num_experts, c.top_k, torch.Generator().manual_seed(t))
                _force_routing(layer, w.to(dev), ids.to(dev))
            graphs, outs = {}, {}
            for s in settings:
                if s != "base":
                    exec(s, ns)
                try:
                    layer(x)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        y = layer(x)
                    g.replay()
                    torch.cuda.synchronize()
                finally:
                    _restore(ns, defaults)
                graphs[s], outs[s] = g, y.clone()
            times = {s: [] for s in settings}
            with flush_mode(args.flush):
                for _ in range(args.rounds):
                    for s in settings:
                        times[s].append(triton.testing.do_bench(graphs[s].replay, warmup=20, rep=150,
                                                                return_mode="median") * 1e3)
            base = statistics.median(times[settings[0]])
            for s in settings:
                same = bool(torch.equal(outs[s], outs[settings[0]]))
                rel = ((outs[s].float() - outs[settings[0]].float()).norm()
                       / outs[settings[0]].float().norm().clamp(min=1e-30)).item()
                us = statistics.median(times[s])
                rows.append(dict(config=name, tokens=t, routing=kind, setting=s, us=us, rounds=times[s],
                                 speedup=base / us, same_bits=same, rel_vs_base=rel))
                print(f"{name} T={t} {kind} [{s}]: {us:.1f} us ({base / us:.3f}x) rounds "
                      f"{[round(v, 1) for v in times[s]]} same bits {same} rel {rel:.1e}", flush=True)
            del graphs, outs
            if kind != "router":
                from bench_moe_skew import _unforce_routing

                _unforce_routing()
                del layer.route  # back to the class's method
        del layer
        ns.pop("layer")
        torch.cuda.empty_cache()
    tag = f"_{args.tag}" if args.tag else ""
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv), flush=args.flush)
    with open(os.path.join(args.out, f"ab_layer_settings{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# MoE layer settings A/B, graph replay ({meta['device']})", "",
             f"- date {meta['date']}; torch {meta['torch']}; triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             f"- do_bench median of graph replays, L2 cleared before each by a {args.flush} flush; median over the "
             f"interleaved rounds; speed-up = first setting / setting", "",
             "| config | tokens | routing | setting | us | speed-up | rounds | same bits as the first | rel. diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['tokens']} | {r['routing']} | `{r['setting']}` | {r['us']:.1f} | "
              f"{r['speedup']:.3f}x | {', '.join(f'{v:.1f}' for v in r['rounds'])} | "
              f"{'yes' if r['same_bits'] else 'no'} | {r['rel_vs_base']:.1e} |" for r in rows]
    with open(os.path.join(args.out, f"ab_layer_settings{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
