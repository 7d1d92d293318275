"""Decode MoE layer: the existing multi-launch path vs the single-launch fused decode kernel (issue 11, v1).

For each config and token count: ``Nvfp4MoE`` (w4a16, random weights, ``fused_decode=True``) timed in CUDA-graph
replay with ``fused_decode`` off (route+dispatch, gate_up GEMM, down GEMM, combine) and on (route+dispatch, one
fused launch). Each timed replay follows an L2 flush (a 256 MiB write) and is bracketed by CUDA events; the
median over ``--iters`` replays with 4 rotating input batches is reported. HBM floor: bytes of the touched
experts' weights (+ shared expert + gate, ``Nvfp4MoE.weight_bytes``) / 3.0 TB/s, averaged over the 4 batches.
Numerics: the fused output vs the existing path's and vs the float32 oracle (``reference_forward``): relative
Frobenius error; "same bits": fused graph replay == fused eager == fused eager again.

Usage: python benchmarks/bench_moe_fused_decode.py [--configs v4-flash,v4-pro] [--tokens 1,2,4,8,16]
       [--iters 50] [--out-dir benchmarks/results] [--tag moe_fused_decode_v1] [--config 1,64,128,4]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

HBM_BYTES_PER_S = 3.0e12


def _time_replays(graph, static_in, xs, flush, iters: int) -> float:
    """Median us of ``graph.replay()`` after an L2 flush, inputs rotating over ``xs``."""
    times = []
    for i in range(iters + 3):
        static_in.copy_(xs[i % len(xs)])
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_config(config, token_counts, iters: int, seed: int = 0):
    from megamoe.layers.moe import Nvfp4MoE

    layer = Nvfp4MoE.random(config, seed=seed, max_num_tokens=max(token_counts), device="cuda", fused_decode=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    c = config
    for t in token_counts:
        xs = [torch.randn(t, c.hidden_size, device="cuda").to(torch.bfloat16) for _ in range(4)]
        touched = []
        for x in xs:
            _, ids = layer.route(x)
            touched.append(int(torch.unique(ids).numel()))
        floor_us = statistics.mean(layer.weight_bytes(n) for n in touched) / HBM_BYTES_PER_S * 1e6
        row = {"config": c.name, "tokens": t, "experts_touched": statistics.mean(touched), "hbm_floor_us": floor_us}
        outs = {}
        for name, fused in (("existing", False), ("fused", True)):
            layer.fused_decode = fused
            eager = layer.forward(xs[0]).clone()
            run = layer.capture(t)
            us = _time_replays(run.graph, run.static_input, xs, flush, iters)
            graph_out = run(xs[0]).clone()
            again = layer.forward(xs[0]).clone()
            row[f"{name}_us"] = us
            row[f"{name}_pct_of_floor"] = 100.0 * floor_us / us
            row[f"{name}_same_bits"] = bool(torch.equal(graph_out, eager) and torch.equal(again, eager))
            outs[name] = eager
            del run
        layer.fused_decode = True
        layer.forward(xs[0])
        ref = layer.reference_forward(xs[0], layer.last_routing)
        row["fused_vs_existing_rel"] = _rel(outs["fused"], outs["existing"])
        row["fused_vs_oracle_rel"] = _rel(outs["fused"], ref)
        row["existing_vs_oracle_rel"] = _rel(outs["existing"], ref)
        row["speedup"] = row["existing_us"] / row["fused_us"]
        rows.append(row)
        print(f"{c.name} T={t}: existing {row['existing_us']:.1f} us, fused {row['fused_us']:.1f} us, floor "
              f"{floor_us:.1f} us", flush=True)
    del layer
    torch.cuda.empty_cache()
    return rows


def write_results(rows, out_dir, tag, command):
    import triton

    os.makedirs(out_dir, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": command, "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "fused_configs": str(__import__("megamoe.kernels.moe_fused_decode", fromlist=["x"]).FUSED_DECODE_CONFIGS)}
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# Decode MoE layer: existing path vs single-launch fused decode (issue 11, v1)", "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{command}`; fused kernel configs (max tokens: ROWS, BLOCK_N, BLOCK_K, warps, maxnreg): "
        f"{meta['fused_configs']}",
        "- us: CUDA-graph replay of the whole layer (route+dispatch included), median, L2 flushed before each replay;"
        " floor = touched weights (+ shared + gate) / 3.0 TB/s; same bits = graph == eager == eager again;"
        " rel = relative Frobenius error on batch 0", "",
        "| config | tokens | experts touched | existing us | fused us | speedup | floor us | existing % floor "
        "| fused % floor | same bits (existing / fused) | fused vs existing rel | fused vs oracle rel "
        "| existing vs oracle rel |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['tokens']} | {r['experts_touched']:.1f} | {r['existing_us']:.1f} | "
            f"{r['fused_us']:.1f} | {r['speedup']:.2f}x | {r['hbm_floor_us']:.1f} | "
            f"{r['existing_pct_of_floor']:.0f}% | "
            f"{r['fused_pct_of_floor']:.0f}% | {r['existing_same_bits']} / {r['fused_same_bits']} | "
            f"{r['fused_vs_existing_rel']:.1e} | {r['fused_vs_oracle_rel']:.1e} | {r['existing_vs_oracle_rel']:.1e} |")
    path = os.path.join(out_dir, f"{tag}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v4-flash,v4-pro")
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="moe_fused_decode_v1")
    p.add_argument("--config", default=None,
                   help="ROWS,BLOCK_N,BLOCK_K,num_warps[,maxnreg] for the fused kernel at every token count "
                        "(default: moe_fused_decode.FUSED_DECODE_CONFIGS)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_fused_decode: needs a CUDA GPU")
        return 1
    from megamoe.kernels import moe_fused_decode
    from megamoe.models.config import PRESETS

    if args.config:
        v = [int(a) for a in args.config.split(",")]
        moe_fused_decode.FUSED_DECODE_CONFIGS.clear()
        moe_fused_decode.FUSED_DECODE_CONFIGS[moe_fused_decode.FUSED_DECODE_MAX_TOKENS] = \
            tuple(v[:4]) + ((v[4] if len(v) > 4 else None),)

    tokens = [int(v) for v in args.tokens.split(",")]
    rows = []
    command = "python benchmarks/bench_moe_fused_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for name in args.configs.split(","):
        rows += bench_config(PRESETS[name], tokens, args.iters, args.seed)
        path = write_results(rows, args.out_dir, args.tag, command)  # after each config: a timeout keeps the rest
    print(open(path).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
