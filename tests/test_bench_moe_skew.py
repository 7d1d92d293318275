"""CPU check of benchmarks/bench_moe_skew.py's forced routing: the layer's forward must use the fixed ids and
weights (it routes through ``megamoe.ops.moe.route_dispatch``, which the benchmark replaces while it runs). Until
2026-11-26 only ``layer.route`` was replaced, forward ignored it, and every "routing" timed the router's own."""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench_moe_skew = importlib.import_module("bench_moe_skew")

from megamoe.layers.moe import Nvfp4MoE  # noqa: E402
from megamoe.models.config import MoEConfig  # noqa: E402
from megamoe.ops import moe as moe_ops  # noqa: E402


def test_forced_routing_reaches_forward():
    c = MoEConfig(hidden_size=128, intermediate_size=64, num_experts=8, top_k=2, shared_intermediate_size=64)
    layer = Nvfp4MoE.random(c, seed=0, max_num_tokens=16, device="cpu")
    t = 5
    weights, ids = bench_moe_skew.routing("all-on-k", t, c.num_experts, c.top_k, torch.Generator().manual_seed(1))
    x = torch.randn(t, c.hidden_size).to(torch.bfloat16)
    own = layer.forward(x).float().clone()
    original = moe_ops.route_dispatch
    try:
        bench_moe_skew._force_routing(layer, weights, ids)
        forced = layer.forward(x).float().clone()
        assert torch.equal(layer.last_routing[1][:t].to(torch.int32), ids)
    finally:
        bench_moe_skew._unforce_routing()
    assert moe_ops.route_dispatch is original
    ref = layer.reference_forward(x, routing=(weights, ids))
    assert ((forced - ref).norm() / ref.norm()).item() < 2e-2
    assert ((own - ref).norm() / ref.norm()).item() > 0.1  # the router's own choice is told apart


def test_forced_routing_writes_the_paired_x():
    """The stand-in for route_dispatch also writes ``x_paired_out`` (the route launch's paired copy of x, which the
    expert GEMMs read at 1-8 tokens on CUDA): without it they read a stale buffer."""
    from megamoe.format.mma_order import to_paired_order

    weights, ids = bench_moe_skew.routing("zipf", 4, 8, 2, torch.Generator().manual_seed(2))
    x = torch.randn(4, 64).to(torch.bfloat16)
    paired = torch.full((6, 64), float("nan"), dtype=torch.bfloat16)
    gate = torch.randn(8, 64)
    try:
        bench_moe_skew._force_routing(type("L", (), {})(), weights, ids)
        moe_ops.route_dispatch(x, gate, None, top_k=2, x_paired_out=paired)
    finally:
        bench_moe_skew._unforce_routing()
    assert torch.equal(paired[:4], to_paired_order(x)) and paired[4:].isnan().all()
