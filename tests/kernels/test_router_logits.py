"""Tensor-core router logits (megamoe/kernels/router_logits.py) against float64 ``x @ gate^T``.

The bound is the kernel's documented one, ``(2 BLOCK_K + ceil(H / BLOCK_K) + 4) u * sum_h |x_h| |w_eh|``, far
inside the routing guarantee's gamma_H; a kernel that rounds an fp32 gate to bf16 (no split) or drops a K chunk
exceeds it (checked). Interpreter on CPU (fresh process), H100 with ``cuda``; plus the op: the "triton" route
backend from ROUTER_TC_MIN_TOKENS tokens under the routing guarantee, graph replay == eager, sync-free.
"""
import os
import subprocess
import sys

import pytest
import torch

from megamoe.kernels.router_logits import MAX_BLOCK_K, launch_router_logits

U = 2.0 ** -24


def logit_bound(x, gate):
    """Per element: the kernel's error bound (float64)."""
    block_k = MAX_BLOCK_K  # the bound of the config with the largest chunk (both configs run below)
    hidden = x.shape[1]
    factor = (2 * block_k + -(-hidden // block_k) + 4) * U
    return factor * (x.double().abs() @ gate.double().abs().t())


def check_logits(logits, x, gate):
    exact = x.double() @ gate.double().t()
    err = (logits.double() - exact).abs()
    bound = logit_bound(x, gate)
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), err * float("inf")).nan_to_num(0.0)
    assert (err <= bound).all(), ratio.max().item()
    return ratio.max().item()


def cases(device, gen):
    """(x, gate) pairs: bf16 and fp32 gates (fp32 values that bf16 cannot hold), H not a multiple of BLOCK_K,
    T / E not multiples of the tile, zeros, and a row of large values."""
    out = []
    for t, e, h in ((70, 37, 200), (129, 64, 128), (5, 3, 64), (200, 40, 384)):  # small-T and default configs
        x = torch.randn(t, h, generator=gen).bfloat16()
        x[0] = 0
        if t > 3:
            x[3] *= 1e4
        gate32 = torch.randn(e, h, generator=gen) * h ** -0.5
        out.append((x.to(device), gate32.bfloat16().to(device)))
        out.append((x.to(device), gate32.to(device)))
    return out


_CPU_CODE = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_router_logits import cases, check_logits, logit_bound
from megamoe.kernels.router_logits import launch_router_logits
gen = torch.Generator().manual_seed(0)
for x, gate in cases("cpu", gen):
    logits = launch_router_logits(x, gate, interpreter=True)
    check_logits(logits, x, gate)
    if gate.dtype == torch.float32:
        # an fp32 gate rounded to bf16 (no split) fails the bound
        wrong = launch_router_logits(x, gate.bfloat16(), interpreter=True)
        exact = x.double() @ gate.double().t()
        assert ((wrong.double() - exact).abs() > logit_bound(x, gate)).any()
print("ok")
"""


def test_interpreter_within_bound():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _CPU_CODE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.cuda
def test_cuda_within_bound_and_deterministic():
    gen = torch.Generator().manual_seed(1)
    dev = torch.device("cuda")
    worst = 0.0
    for x, gate in cases(dev, gen):
        worst = max(worst, check_logits(launch_router_logits(x, gate), x, gate))
    # V4-Flash shape: the same bits twice, and a dropped K chunk (H - 64) fails the bound
    x = torch.randn(4096, 4096, generator=gen).bfloat16().to(dev)
    gate = (torch.randn(256, 4096, generator=gen) * 4096 ** -0.5).bfloat16().to(dev)
    a = launch_router_logits(x, gate)
    check_logits(a, x, gate)
    assert torch.equal(a, launch_router_logits(x, gate))
    short = launch_router_logits(x[:, :-64].contiguous(), gate[:, :-64].contiguous())
    exact = x.double() @ gate.double().t()
    assert ((short.double() - exact).abs() > logit_bound(x, gate)).any()


@pytest.mark.cuda
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_cuda_route_triton_backend_guarantee(scoring):
    """The op from ROUTER_TC_MIN_TOKENS tokens: ids / weights under the routing guarantee (ops/test_moe_route_dispatch's
    checker), graph replay == eager, no host sync."""
    from megamoe.ops import moe as moe_ops
    from sync_helpers import no_host_syncs
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
    from test_moe_route_dispatch import _check_guarantee

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2)
    t, e, h, k = max(moe_ops.ROUTER_TC_MIN_TOKENS, 300), 256, 1024, 6
    x = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    x[5, 3] = float("nan")
    gate = (torch.randn(e, h, generator=gen) * h ** -0.5).bfloat16().to(dev)
    bias = (torch.rand(e, generator=gen) * 0.05).to(dev)
    kw = dict(top_k=k, scoring_func=scoring, routed_scaling_factor=1.5, backend="triton")
    w, ids = moe_ops.route(x, gate, bias, **kw)
    skipped = _check_guarantee(x.cpu(), gate.cpu(), bias.cpu(), w.cpu(), ids.cpu(), k, scoring, scale=1.5)
    assert skipped < t // 10
    assert ids[5].tolist() == list(range(k)) and torch.isnan(w[5]).all()
    out = (torch.empty(t, k, device=dev), torch.empty(t, k, dtype=torch.int32, device=dev))
    moe_ops.route(x, gate, bias, out=out, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_ops.route(x, gate, bias, out=out, **kw)
    with no_host_syncs():
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[1], ids) and torch.equal(out[0].nan_to_num(7.0), w.nan_to_num(7.0))
