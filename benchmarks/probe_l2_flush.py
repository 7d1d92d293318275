"""Probe: how much of a "L2 cleared" graph-replay time is the cache flush's own write-back? (issues 11, 15)

``triton.testing.do_bench`` clears the L2 before every repetition by ZEROING a 256 MB buffer. The H100's L2 is
write-back, so the flush leaves up to ~50 MB of dirty lines behind, and the timed kernel's first misses evict them:
HBM writes the timed code never asked for. A cold-cache state without that is a flush that READS 256 MB (the L2 then
holds clean lines of the flush buffer; the timed data is still not cached). This script times the same CUDA graph
after each kind of flush, in one run, for the streams and layers whose "% of the HBM floor" the issues measure:

* a read-only stream of 117 MB (probe_stream's ``contiguous`` kernel) and ``torch copy_`` of 117 MB;
* the MoE layer (w4a16, defaults) at V4-Flash 1 / 8 tokens and V4-Pro 1 token;
* ``nvfp4_linear`` 18432x7168 and 4096x4096 at M = 1;
* the sparse decode attention (bench_attention's cases) CSA 32k and HCA 128k at batch 32 / 128.

Per repetition: flush, event, replay, event; the median over ``--reps`` (after 10 warm-up replays). "none" (no
flush) is listed for reference: there the layer's routing and weights may be partly L2-resident.

Run (H100): ``python benchmarks/probe_l2_flush.py [--reps 100] [--out FILE.md]`` (also writes FILE.json).
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

FLUSH_BYTES = 256 << 20


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_replays(graph, flush, reps: int) -> float:
    """Median us of ``graph.replay()`` timed by events, ``flush()`` (untimed) before each."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(10):
        flush()
        graph.replay()
    for i in range(reps):
        flush()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def workloads(dev):
    """[(name, bytes the workload must move from HBM or None, graph)] built lazily, one at a time."""
    from probe_stream import _contiguous_kernel

    n = 117 << 20
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (n // 4,), dtype=torch.int32, device=dev)
    sink = torch.empty(n // (8192 * 28), dtype=torch.int32, device=dev)
    yield "read stream 117 MB (contiguous, 512 programs)", n, _graph(
        lambda: _contiguous_kernel[(sink.numel(),)](src, sink, CHUNK=8192, STEPS=28))
    dst = torch.empty_like(src)
    yield "torch copy_ 117 MB (read + write bytes)", 2 * n, _graph(lambda: dst.copy_(src))
    src = dst = sink = None  # the graphs above have been timed (the generator resumes after)
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    for name, tokens in (("v4-flash", (1, 8)), ("v4-pro", (1,))):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        for t in tokens:
            x = torch.randn(t, c.hidden_size, device=dev, generator=torch.Generator(device=dev).manual_seed(t))
            x = x.bfloat16()
            yield f"MoE layer {name}, {t} token(s)", None, _graph(lambda: layer(x))
        layer = None
        torch.cuda.empty_cache()
    from megamoe.ops.gemm import nvfp4_linear
    from megamoe.ops.quantize import quantize

    for n_out, k in ((18432, 7168), (4096, 4096)):
        w = quantize(torch.randn(n_out, k, device=dev) * 0.05)
        x = torch.randn(1, k, device=dev).bfloat16()
        out = torch.empty(1, n_out, dtype=torch.bfloat16, device=dev)
        yield f"nvfp4_linear {n_out}x{k}, M = 1", n_out * k * 9 // 16, _graph(lambda: nvfp4_linear(x, w, out=out))
        w = None
    import bench_attention as ba

    for kind, ctx in (("csa", 32768), ("hca", 131072)):
        for b in (32, 128):
            c = ba.make_case(b, ctx, kind, dev)
            k = c["entry_idx"].shape[1]
            ws = ba.attention_workspace(b, ba.H, ba.D, ba.WINDOW, k, dev)
            out = torch.empty_like(c["q"])
            kw = {key: v for key, v in c.items() if key not in ("q", "attn_sink")}
            rows = b * (ba.WINDOW * ba.ROW_BYTES + k * ba.ENTRY_BYTES)
            total = rows + b * (2 * ba.H * ba.D * 2 + 4 * (ba.WINDOW + k))
            yield f"attention {kind} {ctx // 1024}k, batch {b}", total, _graph(
                lambda: ba.sparse_mqa_attention(c["q"], c["attn_sink"], ba.D ** -0.5, out=out, workspace=ws, **kw))
            c = ws = out = None
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_l2_flush.py needs a CUDA GPU")
        return 0
    dev = torch.device("cuda")
    from graph_timing import read_cache

    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=dev)
    flushes = {"write (do_bench)": cache.zero_, "read": lambda: read_cache(cache), "none": lambda: None}
    rows = []
    for name, nbytes, graph in workloads(dev):
        us = {mode: time_replays(graph, flush, args.reps) for mode, flush in flushes.items()}
        row = dict(workload=name, bytes=nbytes, **{f"us_{k.split()[0]}": v for k, v in us.items()})
        rows.append(row)
        extra = "" if nbytes is None else "  (" + ", ".join(
            f"{k.split()[0]} {nbytes / v / 1e6:.2f} TB/s" for k, v in us.items()) + ")"
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()) + extra, flush=True)
        del graph
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv))
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        lines = [f"# Graph replay after a write flush, a read flush and none ({meta['device']})", "",
                 f"- date {meta['date']}; torch {meta['torch']}; triton {meta['triton']}",
                 f"- command: `{meta['command']}`",
                 f"- flush: write = zero a {FLUSH_BYTES >> 20} MB buffer (do_bench's), read = sum it, none; median "
                 f"of {args.reps} replays, each timed by events after its (untimed) flush", "",
                 "| workload | MB | write us | read us | none us | write / read | TB/s write | TB/s read |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            mb = "" if r["bytes"] is None else f"{r['bytes'] / 2 ** 20:.1f}"
            tb = ("", "") if r["bytes"] is None else (f"{r['bytes'] / r['us_write'] / 1e6:.2f}",
                                                      f"{r['bytes'] / r['us_read'] / 1e6:.2f}")
            lines.append(f"| {r['workload']} | {mb} | {r['us_write']:.1f} | {r['us_read']:.1f} | {r['us_none']:.1f} | "
                         f"{r['us_write'] / r['us_read']:.3f} | {tb[0]} | {tb[1]} |")
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
