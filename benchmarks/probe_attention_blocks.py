"""Where the sparse decode attention's time goes: fixed cost per program vs cost per row block (issue 15).

For each main kernel (``--impls``, default v2 "ws" and v3 "ws3") and batch (``--batches``), times the op with a
128-row window and ``K`` compressed entries per query for ``--entries`` (HCA-style: all entries of a 128k-context
request, so the rows are real gathers from a large pool), and reports the least-squares line
``time = fixed + per_block * blocks`` over the points (``blocks`` = the kernel's row blocks per program). Two
timings per point, both medians of CUDA-graph replays: ``cold`` with the L2 cleared before each replay
(``bench_attention.bench_graph``, as every attention result) and ``warm`` without (the rows of a batch of 8-32
fit in the 50 MB L2, so this isolates latency from bandwidth).

``--timeline``: instead, one eager launch of the v3 kernel's probe build (``launch_ws3(times=...)``, L2 cleared
first) per batch and entry count, and the median over programs of each partition's global-timer stamps,
relative to the earliest program start (us).

Usage: python benchmarks/probe_attention_blocks.py [--impls ws,ws3] [--batches 32,128]
       [--entries 0,64,256,512,1024] [--timeline] [--out benchmarks/results/attn_v3/blocks]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="ws,ws3")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--entries", default="0,64,256,512,1024")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--config", default="", help="--timeline: WS3_CONFIG overrides, e.g. PREFETCH=0,PREFETCH=2 "
                    "(one timeline per comma-separated item; empty: the default config)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attn_v3", "blocks"))
    args = ap.parse_args()
    if args.timeline:
        timeline(args)
        return
    import bench_attention as ba
    from megamoe.kernels import sparse_attention as kernels
    from megamoe.ops.attention import attention_workspace

    dev = torch.device("cuda")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        base = ba.make_case(batch, 131072, "hca", dev)  # 1024 entries per request
        for k in (int(x) for x in args.entries.split(",")):
            c = dict(base, entry_idx=base["entry_idx"][:, :k].contiguous())
            B, H, D = c["q"].shape
            ws = attention_workspace(B, H, D, ba.WINDOW, max(k, 1), dev)
            for impl in args.impls.split(","):
                out = torch.empty_like(c["q"])
                kw = {n: v for n, v in c.items() if n not in ("q", "attn_sink")}

                def run():
                    kernels.launch_sparse_mqa_attention(
                        c["q"], c["attn_sink"], D ** -0.5, kw["window_kv"], kw["window_idx"], kw["entries_fp8"],
                        kw["entries_scale"], kw["entries_rope"], kw["block_table"], kw["slots"], kw["entry_idx"],
                        out, workspace=ws, impl=impl)

                cold = ba.bench_graph(run)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                warm = _warm(graph)
                block_n = kernels.main_block_n(impl)
                splits, per = kernels.choose_num_splits(B, H, ba.WINDOW, k, block_n=block_n)
                blocks = triton.cdiv(ba.WINDOW, block_n) + triton.cdiv(k, block_n)
                rows.append(dict(impl=impl, batch=B, entries=k, splits=splits, blocks_per_program=min(per, blocks),
                                 cold_us=cold * 1e6, warm_us=warm * 1e6))
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| impl | batch | entries | splits | blocks / program | cold us | warm us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['batch']} | {r['entries']} | {r['splits']} | {r['blocks_per_program']} | "
                     f"{r['cold_us']:.1f} | {r['warm_us']:.1f} |")
    lines += ["", "| impl | batch | timing | fixed us | per block us |", "|---|---|---|---|---|"]
    for impl in args.impls.split(","):
        for batch in sorted({r["batch"] for r in rows}):
            pts = [r for r in rows if r["impl"] == impl and r["batch"] == batch]
            for key in ("cold_us", "warm_us"):
                x = torch.tensor([float(r["blocks_per_program"]) for r in pts], dtype=torch.float64)
                y = torch.tensor([r[key] for r in pts], dtype=torch.float64)
                a = torch.stack([torch.ones_like(x), x], dim=1)
                fixed, per_block = torch.linalg.lstsq(a, y[:, None]).solution.flatten().tolist()
                lines.append(f"| {impl} | {batch} | {key[:-3]} | {fixed:.1f} | {per_block:.2f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       triton=triton.__version__), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Attention: fixed vs per-block cost ({torch.cuda.get_device_name(0)})\n\n{text}\n")


STAMPS = ("entry", "q_ready", "first_block_ready", "score_loop_end", "score_epilogue_end", "value_loop_end",
          "value_epilogue_end", "first_block_produced", "producer_end")


def timeline(args) -> None:
    import bench_attention as ba
    from megamoe.kernels import sparse_attention as kernels
    from megamoe.kernels import sparse_attention_ws3 as ws3
    from megamoe.ops import errors

    dev = torch.device("cuda")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    lines = ["| config | batch | entries | splits | blocks / program | " + " | ".join(STAMPS) + " | kernel span |",
             "|" + "---|" * (6 + len(STAMPS))]
    rows = []
    configs = [dict([item.split("=")]) for item in args.config.split(",") if item] or [{}]
    for cfg, batch in ((cfg, int(b)) for cfg in configs for b in args.batches.split(",")):
        cfg = {k: int(v) for k, v in cfg.items()}
        base = ba.make_case(batch, 131072, "hca", dev)
        for k in (int(x) for x in args.entries.split(",")):
            c = dict(base, entry_idx=base["entry_idx"][:, :k].contiguous())
            B, H, D = c["q"].shape
            splits, per = kernels.choose_num_splits(B, H, ba.WINDOW, k, block_n=ws3.WS3_CONFIG["BLOCK_N"])
            acc_shape, ml_shape = kernels.workspace_shapes(B, H, D, splits)
            ws_acc = torch.empty(acc_shape, device=dev) if splits > 1 else c["attn_sink"]
            ws_ml = torch.empty(ml_shape, device=dev) if splits > 1 else c["attn_sink"]
            programs = B * triton.cdiv(H, ws3.WS3_CONFIG["BLOCK_H"]) * splits
            times = torch.zeros(programs * 16, dtype=torch.int64, device=dev)
            out = torch.empty_like(c["q"])
            for _ in range(3):
                flush.zero_()
                ws3.launch_ws3(c["q"], c["attn_sink"], D ** -0.5, c["window_kv"], c["window_idx"], c["entries_fp8"],
                               c["entries_scale"], c["entries_rope"], c["block_table"], c["slots"], c["entry_idx"],
                               out, splits=splits, per=per, ws_acc=ws_acc, ws_ml=ws_ml,
                               error_word=errors.error_word(dev), pdl=False, times=times, config=cfg)
            torch.cuda.synchronize()
            t = times.view(programs, 16)[:, :len(STAMPS)].double()
            t = (t - t[:, 0].min()) * 1e-3
            med = t.median(dim=0).values.tolist()
            span = float(t.max())
            blocks = triton.cdiv(ba.WINDOW, ws3.WS3_CONFIG["BLOCK_N"]) + triton.cdiv(k, ws3.WS3_CONFIG["BLOCK_N"])
            rows.append(dict(config=cfg, batch=B, entries=k, splits=splits, blocks_per_program=min(per, blocks),
                             median_us=dict(zip(STAMPS, med)), span_us=span))
            print(json.dumps(rows[-1]), flush=True)
            lines.append(f"| {cfg or 'default'} | {B} | {k} | {splits} | {min(per, blocks)} | " +
                         " | ".join(f"{v:.1f}" for v in med) +
                         f" | {span:.1f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name(0)), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Attention v3 timeline: median stamps over programs, us ({torch.cuda.get_device_name(0)})\n\n"
                f"{text}\n")


def _warm(graph) -> float:
    """Median seconds of one graph replay, back to back (no L2 clearing), from CUDA events."""
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
