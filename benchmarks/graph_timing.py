"""One timing rule for the A/B benchmark scripts: a CUDA-graph replay of ``fn``, L2 cleared before each replay
(``triton.testing.do_bench``), the median in microseconds."""
from __future__ import annotations

import torch
import triton


def graph_replay_us(fn, warmup: int = 10, rep: int = 100) -> float:
    """Run ``fn`` once (compiles, allocates), capture one call in a CUDA graph, return the median replay in us."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3
