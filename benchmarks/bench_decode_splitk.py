"""Grouped decode split-K (issue 11; megamoe/kernels/gemm/nvfp4_mma_decode.py SPLIT modes): on vs off.

Per config (V4-Flash, V4-Pro) and token count (1, 2, 4, 8, 16; top-6, rows = 6 x tokens, no shared expert):
``nvfp4_grouped_mm`` gate_up (row_index gather + SwiGLU + clamp, interleaved weights) and down, each captured in
a CUDA graph with split-K planned (``megamoe.ops.gemm.DECODE_SPLITK = None``, the default) and off (``= 1``, as
``MEGAMOE_DECODE_SPLITK=0``), for two routings: ``random`` (distinct random top-6 per token) and ``concentrated``
(every token on the same 6 experts: one-hot-ish). ``floor``: the touched experts' NVFP4 bytes (N*K*9/16) / 3.0
TB/s. ``S``: the split count the launcher plans (1 = off). Then the whole MoE layer (``Nvfp4MoE.random``, as
benchmarks/bench_guard.py builds it; w4a16, shared expert fused) at 1 and 8 tokens, captured with split-K on
and off. The outputs of on / off are compared (max |diff| in bf16 ulps of the output's scale).

Timing: ``triton.testing.do_bench(graph.replay, return_mode="median")`` (L2 cleared before every replay).
Usage: python benchmarks/bench_decode_splitk.py [--configs v4-flash,v4-pro] [--tokens 1,2,4,8,16]
       [--layer-tokens 1,8] [--rep-ms 30] [--out-dir DIR (default $OUT or benchmarks/results)] [--tag decode_splitk_v1]
Writes ``<tag>.md`` and ``<tag>.json`` (date, device, versions, command). ~2-3 minutes on an H100.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout
sys.path.insert(0, os.path.join(ROOT, "tests"))  # gemm_helpers.random_codes_weight

SHAPES = {"v4-flash": (4096, 2048, 256), "v4-pro": (7168, 3072, 384)}  # H, I, E
HBM_BYTES_PER_S = 3.0e12
TOP_K = 6


def _graph(fn):
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _time(g, rep_ms):
    import triton.testing

    return triton.testing.do_bench(g.replay, warmup=5, rep=rep_ms, return_mode="median") * 1e3


def _routing(kind, e, tokens, gen):
    import torch

    if kind == "random":
        ids = torch.stack([torch.randperm(e, generator=gen)[:TOP_K] for _ in range(tokens)])
    else:
        ids = torch.randperm(e, generator=gen)[:TOP_K].expand(tokens, TOP_K)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    order = torch.argsort(ids.reshape(-1), stable=True)
    row_index = (order // TOP_K).to(torch.int32)  # sorted row -> its token
    return counts, row_index


def bench_gemms(name, tokens_list, rep_ms, rows):
    import torch

    from gemm_helpers import random_codes_weight
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma
    from megamoe.kernels.gemm.nvfp4_gemm import _num_sms
    from megamoe.ops import gemm as ops_gemm

    h, i, e = SHAPES[name]
    dev = torch.device("cuda")
    t0 = time.time()
    w13 = random_codes_weight((e, 2 * i, h), dev, scale_shape=(e, 1, 1))
    w2 = random_codes_weight((e, h, i), dev, scale_shape=(e, 1, 1))
    print(f"{name}: weights built in {time.time() - t0:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    for tokens in tokens_list:
        t = TOP_K * tokens
        for kind in ("random", "concentrated"):
            counts, row_index = _routing(kind, e, tokens, gen)
            offsets = counts.cumsum(0).to(torch.int32).to(dev)
            row_index = row_index.to(dev)
            touched = int((counts > 0).sum())
            x = torch.randn(tokens, h, device=dev).bfloat16()
            inter_in = torch.randn(t, i, device=dev).bfloat16()
            for proj, w, n, k in (("gate_up", w13, 2 * i, h), ("down", w2, h, i)):
                out = torch.empty(t, i if proj == "gate_up" else h, dtype=torch.bfloat16, device=dev)

                def fn(w=w, proj=proj, out=out):
                    if proj == "gate_up":
                        return ops_gemm.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, out=out,
                                                         activation="swiglu", swiglu_limit=10.0,
                                                         max_rows_per_expert=tokens)
                    return ops_gemm.nvfp4_grouped_mm(inter_in, w, offsets, out=out, max_rows_per_expert=tokens)

                res = {}
                for setting, value in (("on", None), ("off", 1)):
                    ops_gemm.DECODE_SPLITK = value
                    g, o = _graph(fn)
                    res[setting] = (_time(g, rep_ms), o.clone())
                    del g
                ops_gemm.DECODE_SPLITK = None
                plan = ops_gemm.plan_row_bands(t, e, k, tokens)[0][1]
                chunks = mma.chunk_bound(t, e, plan["config"][0], *plan["row_band"], False, tokens)
                splits, _ = mma.plan_decode_splits(chunks * -(-n // plan["config"][1]), k, plan["config"][2],
                                                   _num_sms(0))
                a, b = res["on"][1].float(), res["off"][1].float()
                scale = b.abs().max().clamp_min(1e-30)
                floor = touched * n * k * 9 / 16 / HBM_BYTES_PER_S * 1e6
                row = dict(config=name, proj=proj, tokens=tokens, routing=kind, touched=touched, splits=splits,
                           on_us=res["on"][0], off_us=res["off"][0], floor_us=floor,
                           max_diff_rel=float((a - b).abs().max() / scale))
                rows.append(row)
                print(f"{name} {proj} {tokens} tok {kind}: S={splits} on {row['on_us']:.1f} off {row['off_us']:.1f}"
                      f" floor {floor:.1f} us", flush=True)
    del w13, w2
    torch.cuda.empty_cache()


def bench_layer(name, tokens_list, rep_ms, rows):
    import torch

    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS
    from megamoe.ops import gemm as ops_gemm

    config = PRESETS[name]
    t0 = time.time()
    layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=max(tokens_list), device="cuda")
    print(f"{name}: layer built in {time.time() - t0:.0f} s", flush=True)
    for t in tokens_list:
        gen = torch.Generator(device="cuda").manual_seed(1234 + t)
        xs = [torch.randn(t, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4)]
        res = {}
        for setting, value in (("on", None), ("off", 1)):
            ops_gemm.DECODE_SPLITK = value
            run = layer.capture(t)
            counter = [0]

            def replay(run=run):
                counter[0] = (counter[0] + 1) % len(xs)
                run(xs[counter[0]])

            import triton.testing

            ms = triton.testing.do_bench(replay, warmup=10, rep=rep_ms, return_mode="median")
            res[setting] = (ms * 1e3, run(xs[0]).clone())
            del run
        ops_gemm.DECODE_SPLITK = None
        a, b = res["on"][1].float(), res["off"][1].float()
        row = dict(config=name, proj="layer", tokens=t, routing="router", on_us=res["on"][0], off_us=res["off"][0],
                   max_diff_rel=float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
        rows.append(row)
        print(f"{name} layer {t} tok: on {row['on_us']:.1f} off {row['off_us']:.1f} us", flush=True)
    del layer
    torch.cuda.empty_cache()


def write(rows, meta, out_dir, tag):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = ["# Grouped decode split-K on vs off (CUDA-graph replay, L2 flushed)", "",
             f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             "- times: do_bench median of graph replays in us; floor = touched experts' NVFP4 bytes / 3.0 TB/s; "
             "S = planned splits; diff = max |on - off| / max |off|", "",
             "| config | GEMM | tokens | routing | touched | S | on us | off us | off/on | floor us | on % floor | diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r.get("floor_us")
        fl_s = "" if fl is None else f"{fl:.1f}"
        pct = "" if fl is None else f"{100 * fl / r['on_us']:.0f}%"
        lines.append(f"| {r['config']} | {r['proj']} | {r['tokens']} | {r['routing']} | {r.get('touched', '')} | "
                     f"{r.get('splits', '')} | {r['on_us']:.1f} | {r['off_us']:.1f} | {r['off_us'] / r['on_us']:.2f}x | "
                     f"{fl_s} | {pct} | "
                     f"{r['max_diff_rel']:.1e} |")
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v4-flash,v4-pro")
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--layer-tokens", default="1,8")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="decode_splitk_v1")
    args = p.parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_decode_splitk: needs a CUDA GPU")
        return 2
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": command, "env_MEGAMOE_DECODE_SPLITK": os.environ.get("MEGAMOE_DECODE_SPLITK")}
    rows = []
    tokens = [int(t) for t in args.tokens.split(",") if t]
    layer_tokens = [int(t) for t in args.layer_tokens.split(",") if t]
    for name in args.configs.split(","):
        bench_gemms(name, tokens, args.rep_ms, rows)
        write(rows, meta, args.out_dir, args.tag)
        if layer_tokens:
            bench_layer(name, layer_tokens, args.rep_ms, rows)
            write(rows, meta, args.out_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
