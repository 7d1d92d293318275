"""Argument validation of the MoE ops that a wrong call used to get past (out= buffers, group capacity, a
non-finite scaling factor, combine's out)."""
import pytest
import torch

from megamoe.ops import moe as moe_ops


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_route_checks_out_buffers(backend):
    x = torch.randn(6, 16).bfloat16()
    gate = torch.randn(8, 16)
    kw = dict(top_k=2, backend=backend)
    w_ok, i_ok = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out\[0\].*\(>= 6, >= 2\)"):
        moe_ops.route(x, gate, None, out=(torch.empty(6, 1), i_ok), **kw)  # (6, 1) cannot take 2 columns
    with pytest.raises(ValueError, match=r"out\[1\]"):
        moe_ops.route(x, gate, None, out=(w_ok, torch.empty(5, 2, dtype=torch.int32)), **kw)
    with pytest.raises(TypeError, match=r"out\[1\].*int32"):
        moe_ops.route(x, gate, None, out=(w_ok, torch.empty(6, 2, dtype=torch.int64)), **kw)
    with pytest.raises(TypeError, match=r"out\[0\].*float32"):
        moe_ops.route(x, gate, None, out=(torch.empty(6, 2).bfloat16(), i_ok), **kw)
    with pytest.raises(ValueError, match="unit column stride"):
        moe_ops.route(x, gate, None, out=(torch.empty(2, 6).t(), i_ok), **kw)
    with pytest.raises(TypeError, match="out"):
        moe_ops.route(x, gate, None, out=w_ok, **kw)
    w, ids = moe_ops.route(x, gate, None, out=(torch.empty(9, 3), torch.empty(9, 3, dtype=torch.int32)), **kw)
    assert w.shape == (6, 2) and ids.shape == (6, 2)


def test_route_rejects_small_group_capacity_and_bad_scale():
    x = torch.randn(3, 16).bfloat16()
    gate = torch.randn(16, 16)
    with pytest.raises(ValueError, match="fewer than top_k"):
        moe_ops.route(x, gate, None, top_k=5, n_group=4, topk_group=1)  # 1 group of 4 experts < 5
    moe_ops.route(x, gate, None, top_k=4, n_group=4, topk_group=1)  # exactly enough
    for bad in (float("nan"), float("inf"), "1.5"):
        with pytest.raises(ValueError, match="routed_scaling_factor"):
            moe_ops.route(x, gate, None, top_k=2, routed_scaling_factor=bad)
    with pytest.raises(ValueError, match="scoring_func"):
        moe_ops.route(x, gate, None, top_k=2, scoring_func="relu")
    with pytest.raises(ValueError, match="n_group"):
        moe_ops.route(x, gate, None, top_k=2, n_group=3)


def test_combine_rejects_a_non_tensor_out():
    y = torch.randn(6, 8).bfloat16()
    inv = torch.arange(6, dtype=torch.int32)
    w = torch.rand(3, 2)
    with pytest.raises(TypeError, match="out: expected a torch.Tensor, got int"):
        moe_ops.combine(y, inv, w, out=5)
    with pytest.raises(ValueError, match="out"):
        moe_ops.combine(y, inv, w, out=torch.empty(3, 8))
