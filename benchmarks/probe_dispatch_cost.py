"""Where the "+disp" time of bench_peer.py goes at large batches (issue 10 side question, 2026-11-26 part 12).

bench_peer's "ours+disp" (dispatch from the top-k ids inside the graph, then the expert GEMMs and the combine) was
1-3 ms slower than "ours" (dispatch precomputed) at V4-Pro 8192 tokens (49152 pairs, the torch dispatch backend),
but ~0-40 us at V4-Flash 4096 (24576 pairs). This times, in CUDA-graph replay (L2 cleared, do_bench median):
* the dispatch alone (``megamoe.ops.moe.dispatch``, torch backend, preallocated buffers) at both sizes;
* one replay of each bench_peer graph under the torch profiler: the kernels and their summed device time.

Run (H100): ``python benchmarks/probe_dispatch_cost.py [--out DIR]`` -> DIR/probe_dispatch_cost.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _kernel_table(graph, label, lines, top=12):
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    lines += [f"### {label}: {len(events)} kernel names, {total:.0f} us of device time in one replay", "",
              "| kernel | calls | us |", "|---|---|---|"]
    for e in events[:top]:
        lines.append(f"| `{e.key[:90]}` | {e.count} | {e.self_device_time_total:.1f} |")
    lines.append("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from bench_moe_skew import routing
    from bench_peer import CONFIGS, _graph, build_ours, ours_forward_fns
    from megamoe.layers.moe import dispatch_buffers
    from megamoe.models.config import PRESETS
    from megamoe.ops import errors
    from megamoe.ops import moe as moe_ops

    dev = torch.device("cuda")
    errors.error_word(dev)
    lines = [f"# Dispatch cost at large batches ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__})", "", "Command: `python " + " ".join(sys.argv) + "`. Uniform routing.", ""]
    for name, tokens in (("v4-flash", 4096), ("v4-pro", 8192)):
        c = PRESETS[CONFIGS[name]]
        gen = torch.Generator().manual_seed(tokens)
        weights, ids = (v.to(dev) for v in routing("uniform", tokens, c.num_experts, c.top_k, gen))
        pairs = tokens * c.top_k
        bufs = dispatch_buffers(pairs, c.num_experts, dev)
        g = torch.cuda.CUDAGraph()
        moe_ops.dispatch(ids, c.num_experts, buffers=bufs, backend="torch")
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            moe_ops.dispatch(ids, c.num_experts, buffers=bufs, backend="torch")
        us = triton.testing.do_bench(g.replay, warmup=10, rep=200, return_mode="median") * 1e3
        lines += [f"## {name}, {tokens} tokens ({pairs} pairs)", "", f"dispatch alone (torch backend): {us:.1f} us", ""]
        print(lines[-2], flush=True)
        w13k, w2 = build_ours(c, 0, dev)
        x = torch.randn(tokens, c.hidden_size, device=dev).bfloat16()
        gemms, full, _ = ours_forward_fns(c, w13k, w2, ids, weights, bufs)
        for label, fn in (("ours (dispatch precomputed)", gemms), ("ours+disp", full)):
            graph, _ = _graph(fn, x)
            t = triton.testing.do_bench(graph.replay, warmup=5, rep=400, return_mode="median") * 1e3
            lines.append(f"{label}: {t:.1f} us (graph replay median)")
            print(lines[-1], flush=True)
            lines.append("")
            _kernel_table(graph, label, lines)
            del graph
        del w13k, w2
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_dispatch_cost.md")
    open(path, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
