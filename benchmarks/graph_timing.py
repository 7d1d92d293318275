"""One timing rule for the A/B benchmark scripts: a CUDA-graph replay of ``fn``, L2 cleared before each replay
(``triton.testing.do_bench``), the median in microseconds; and the choice of how the L2 is cleared.

``do_bench`` clears the L2 by zeroing a 256 MB buffer. The H100's L2 is write-back, so that leaves up to ~50 MB of
dirty lines, and the timed code's first misses write them back to HBM: a 117 MB read stream measured 2.27 TB/s after
it and 2.78 TB/s after a flush that reads the buffer instead (results/gpu_check_v29/b_probe_l2_flush.md).
:func:`flush_mode` ("read") makes ``do_bench`` clear the L2 by reading: cold for the timed data, no write-back.
"""
from __future__ import annotations

import contextlib

import torch
import triton

FLUSH_MODES = ("write", "read")


def read_cache(cache: torch.Tensor, _totals={}) -> None:
    """The "read" flush: sum ``cache`` into one int64 (per device, reused), so the L2 ends up holding clean lines."""
    total = _totals.setdefault(cache.device, torch.empty((), dtype=torch.int64, device=cache.device))
    torch.sum(cache, dim=0, dtype=torch.int64, out=total)


def _swap_clear_cache(mode: str):
    """Make ``do_bench`` clear the L2 by ``mode``; returns the driver's own ``clear_cache`` (to put back)."""
    if mode not in FLUSH_MODES:
        raise ValueError(f"mode: expected one of {FLUSH_MODES}, got {mode!r}")
    driver = triton.runtime.driver.active
    original = driver.clear_cache
    if mode == "read":
        driver.clear_cache = read_cache
    return original


@contextlib.contextmanager
def flush_mode(mode: str = "write"):
    """Within the block, ``triton.testing.do_bench`` clears the L2 by ``mode``: "write" (its own: zero the buffer)
    or "read" (:func:`read_cache`: the L2 ends up holding clean lines of the buffer)."""
    original = _swap_clear_cache(mode)
    try:
        yield
    finally:
        triton.runtime.driver.active.clear_cache = original


def use_flush_mode(mode: str) -> None:
    """:func:`flush_mode` for the rest of the process (a benchmark script's whole run)."""
    _swap_clear_cache(mode)


def add_flush_argument(parser, default: str = "write") -> None:
    """The benchmarks' ``--flush`` option (:data:`FLUSH_MODES`)."""
    parser.add_argument("--flush", default=default, choices=FLUSH_MODES,
                        help="how do_bench clears the L2 before each repetition: write (its own zeroing: leaves dirty "
                             "lines whose write-back the timed code pays) or read (no dirty lines)")


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """Run ``fn`` once (compiles, allocates), capture one call in a CUDA graph, replay it once; return the graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_replay_us(fn, warmup: int = 10, rep: int = 100) -> float:
    """The median replay in us of :func:`capture_graph`'s graph of ``fn``."""
    graph = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3
