"""The fixed cost of a timed CUDA-graph replay: what a kernel that does (almost) nothing takes in the harness the
benchmarks use (``triton.testing.do_bench`` on ``graph.replay``, L2 cleared before each repetition), so that a latency
target can be compared with the part of it no kernel can remove.

Rows, each under do_bench's zeroing flush, a reading flush (``graph_timing.read_cache``) and no flush:
- one kernel of 1 program / of 132 x 4 programs that writes one word per program (the smallest node);
- one kernel of 132 x 4 programs that each load one 128-byte line of a cold 64 MB buffer (one DRAM round trip);
- the same with 2 / 3 dependent loads (a pointer chain, as sparse attention's ids -> page -> rows);
- 32 empty kernels in one graph (the per-node cost inside a graph: replay / 32).

Usage: python benchmarks/probe_graph_overhead.py [--out DIR]   (CUDA only; ~20 s)
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from graph_timing import flush_mode  # noqa: E402


@triton.jit
def _touch_kernel(out_ptr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, pid)


@triton.jit
def _chain_kernel(buf_ptr, out_ptr, n_lines, DEPTH: tl.constexpr):
    # every program starts at its own line; each load's value picks the next line (a dependent chain)
    pid = tl.program_id(0)
    idx = (pid * 7919) % n_lines
    for _ in tl.static_range(DEPTH):
        idx = tl.load(buf_ptr + idx * 32).to(tl.int32) % n_lines
    tl.store(out_ptr + pid, idx)


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.zeros(4 * sms, dtype=torch.int32, device=dev)
    n_lines = (64 << 20) // 128
    buf = torch.randint(0, n_lines, (n_lines * 32,), dtype=torch.int32, device=dev)
    rows = {
        "1 program, one store": lambda: _touch_kernel[(1,)](out),
        f"{4 * sms} programs, one store each": lambda: _touch_kernel[(4 * sms,)](out),
    }
    for depth in (1, 2, 3):
        rows[f"{4 * sms} programs, {depth} dependent DRAM load(s) each"] = (
            lambda d=depth: _chain_kernel[(4 * sms,)](buf, out, n_lines, DEPTH=d))

    def chain32():
        for _ in range(32):
            _touch_kernel[(4 * sms,)](out)

    graphs = {name: _graph(fn) for name, fn in rows.items()}
    graphs["32 kernels of 4 x SMs programs in one graph (us per graph)"] = _graph(chain32)
    results = {}
    for mode in ("write", "read", "none"):
        for name, g in graphs.items():
            if mode == "none":
                # no flush at all: the same replay back to back
                for _ in range(20):
                    g.replay()
                torch.cuda.synchronize()
                ts = []
                for _ in range(200):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    g.replay()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e) * 1e3)
                ts.sort()
                us = ts[len(ts) // 2]
            else:
                with flush_mode(mode):
                    us = triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3
            results[(name, mode)] = us
    head = (f"# Fixed cost of a timed graph replay\n\n- date: {datetime.datetime.now().isoformat(timespec='seconds')}; "
            f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}\n"
            f"- command: `python benchmarks/probe_graph_overhead.py`\n"
            f"- times: median us of `do_bench(graph.replay)` (write = do_bench's zeroing L2 flush, read = a reading "
            f"flush), none = events around back-to-back replays\n")
    lines = [head, "| graph | write flush us | read flush us | no flush us |", "|---|---|---|---|"]
    for name in graphs:
        lines.append(f"| {name} | {results[(name, 'write')]:.2f} | {results[(name, 'read')]:.2f} | "
                     f"{results[(name, 'none')]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
