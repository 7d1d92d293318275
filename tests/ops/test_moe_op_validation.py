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


# ---------------------------------------------------------------- audit: layouts, buffers, scalars
BACKENDS = ["torch", "triton"]


def _ids(tokens=4, k=2, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).int()


def _strided(t):
    """Same values, stride 2 along the last dimension (non-contiguous)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def _bufs(pairs, e, **over):
    b = {"sorted_expert": torch.empty(pairs, dtype=torch.int32), "perm": torch.empty(pairs, dtype=torch.int64),
         "row_index": torch.empty(pairs, dtype=torch.int32), "inv_perm": torch.empty(pairs, dtype=torch.int32),
         "arange": torch.arange(pairs, dtype=torch.int32), "experts": torch.arange(e, dtype=torch.int32),
         "expert_offsets": torch.empty(e, dtype=torch.int32)}
    b.update(over)
    return b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,bad", [
    ("row_index", torch.full((3,), -7, dtype=torch.int32)),  # < T*k = 8 elements
    ("inv_perm", torch.full((3,), -7, dtype=torch.int32)),
    ("sorted_expert", torch.full((3,), -7, dtype=torch.int32)),
    ("perm", torch.full((3,), -7, dtype=torch.int64)),
    ("arange", torch.arange(3, dtype=torch.int32)),
    ("expert_offsets", torch.full((4,), -7, dtype=torch.int32)),  # < E = 8
    ("expert_offsets", torch.full((9,), -7, dtype=torch.int32)),  # (E+1,): docstring says exactly E
    ("experts", torch.arange(4, dtype=torch.int32)),
    ("expert_offsets", torch.full((8,), -7, dtype=torch.int64)),
    ("inv_perm", torch.zeros(8)),
    ("row_index", torch.zeros(8, dtype=torch.int64)),
    ("sorted_expert", torch.zeros(8, dtype=torch.int64)),  # int32 ids: int32 sorted experts
    ("perm", torch.zeros(8, dtype=torch.int32)),
    ("row_index", torch.zeros(2, 8, dtype=torch.int32)),
    ("inv_perm", _strided(torch.zeros(8, dtype=torch.int32))),  # non-contiguous: a copy would not be written back
    ("row_index", _strided(torch.zeros(8, dtype=torch.int32))),
    ("expert_offsets", _strided(torch.zeros(8, dtype=torch.int32))),
    ("row_index", [0] * 8),
])
def test_dispatch_rejects_bad_buffers_before_writing(backend, name, bad):
    ids = _ids()
    bufs = _bufs(8, 8, **{name: bad})
    before = {n: t.clone() for n, t in bufs.items() if isinstance(t, torch.Tensor)}
    with pytest.raises((ValueError, TypeError), match=rf"buffers\['{name}'\]"):
        moe_ops.dispatch(ids, 8, buffers=bufs, backend=backend)
    for n, t in before.items():  # nothing written (in or past any buffer)
        assert torch.equal(bufs[n], t), n


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_fills_valid_buffers_in_place(backend):
    ids = _ids()
    bufs = _bufs(10, 8)  # more than T*k elements is fine; expert_offsets exactly E
    bufs.pop("perm")  # sorted_expert without perm: perm is scratch
    d = moe_ops.dispatch(ids, 8, buffers=bufs, backend=backend)
    ref = moe_ops.dispatch(ids, 8, backend=backend)
    for n in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(d[n], ref[n]), n
        assert d[n].data_ptr() == bufs[n].data_ptr(), n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [0, -1, True, 8.0, None, "8"])
def test_dispatch_rejects_bad_num_experts(backend, bad):
    with pytest.raises((ValueError, TypeError), match="num_experts"):
        moe_ops.dispatch(_ids(), bad, backend=backend)


def test_route_dispatch_rejects_small_buffers_before_writing():
    x = torch.randn(4, 16).bfloat16()
    gate = torch.randn(8, 16)
    wb, ib = torch.full((4, 2), -3.0), torch.full((4, 2), -3, dtype=torch.int32)
    for backend in ("torch", "triton"):
        for name, n in (("row_index", 3), ("inv_perm", 3), ("sorted_expert", 3), ("expert_offsets", 4),
                        ("expert_offsets", 9)):
            bufs = _bufs(8, 8, **{name: torch.full((n,), -7, dtype=torch.int32)})
            with pytest.raises(ValueError, match=rf"buffers\['{name}'\]"):
                moe_ops.route_dispatch(x, gate, None, top_k=2, out=(wb, ib), buffers=bufs, backend=backend,
                                       dispatch_backend="torch")
            assert (wb == -3).all() and (ib == -3).all() and (bufs[name] == -7).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_rejects_bool_and_non_bool_flags(backend):
    x = torch.randn(3, 16).bfloat16()
    gate = torch.randn(8, 16)
    with pytest.raises((ValueError, TypeError), match="top_k"):
        moe_ops.route(x, gate, None, top_k=True, backend=backend)
    with pytest.raises((ValueError, TypeError), match="n_group"):
        moe_ops.route(x, gate, None, top_k=2, n_group=True, backend=backend)
    with pytest.raises((ValueError, TypeError), match="topk_group"):
        moe_ops.route(x, gate, None, top_k=2, n_group=2, topk_group=True, backend=backend)
    with pytest.raises((ValueError, TypeError), match="norm_topk_prob"):
        moe_ops.route(x, gate, None, top_k=2, norm_topk_prob="no", backend=backend)
    with pytest.raises((ValueError, TypeError), match="norm_topk_prob"):
        moe_ops.route_dispatch(x, gate, None, top_k=2, norm_topk_prob=1, backend=backend)


def test_route_triton_non_contiguous_bias_equals_contiguous():
    x = torch.randn(5, 16).bfloat16()
    gate = torch.randn(8, 16)
    bias = torch.rand(8) * 0.5
    want = moe_ops.route(x, gate, bias, top_k=2, backend="triton")
    got = moe_ops.route(x, gate, _strided(bias), top_k=2, backend="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _combine_args(tokens=3, k=2, h=16):
    y = torch.randn(tokens * k + 1, h).bfloat16()
    inv = torch.randperm(tokens * k).int()
    w = torch.rand(tokens, k)
    shared = torch.randn(tokens, h).bfloat16()
    return y, inv, w, shared


def test_combine_non_contiguous_shared_equals_contiguous():
    y, inv, w, shared = _combine_args()
    want = moe_ops.combine(y, inv, w, shared)
    got = moe_ops.combine(y, inv, w, _strided(shared))
    assert torch.equal(got, want)
    got = moe_ops.combine(y, inv, w, shared.t().contiguous().t())  # column-major
    assert torch.equal(got, want)


def test_combine_rejects_out_without_unit_column_stride():
    y, inv, w, shared = _combine_args()
    want = moe_ops.combine(y, inv, w, shared)
    for bad in (torch.zeros(16, 3, dtype=torch.bfloat16).t(), _strided(torch.zeros(3, 16, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match="out"):
            moe_ops.combine(y, inv, w, shared, out=bad)
    padded = torch.zeros(3, 24, dtype=torch.bfloat16)  # padded rows, unit column stride: the kernel takes it
    got = moe_ops.combine(y, inv, w, shared, out=padded[:, :16])
    assert got.data_ptr() == padded.data_ptr() and torch.equal(padded[:, :16], want)
    assert (padded[:, 16:] == 0).all()


@pytest.mark.parametrize("bad", [True, 8.0, None, "8", 0])
def test_check_tid2eid_rejects_bad_num_experts(bad):
    t = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    with pytest.raises((ValueError, TypeError), match="num_experts"):
        moe_ops.check_tid2eid(t, bad, 2)


def test_check_tid2eid_rejects_bad_top_k_and_vocab_size():
    t = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    moe_ops.check_tid2eid(t, 8, 2, 16)
    with pytest.raises((ValueError, TypeError), match="top_k"):
        moe_ops.check_tid2eid(t, 8, 2.0)
    with pytest.raises((ValueError, TypeError), match="vocab_size"):
        moe_ops.check_tid2eid(t, 8, 2, "16")


def _fused_decode_args():
    from megamoe.reference.quantize import quantize

    g, h, i, tokens, slots = 3, 32, 32, 2, 2
    w13 = quantize(torch.randn(g, 2 * i, h) * 0.05)
    w2 = quantize(torch.randn(g, h, i) * 0.05)
    return (torch.randn(tokens, h).bfloat16(), w13, w2, torch.tensor([2, 4, 4], dtype=torch.int32),
            torch.tensor([0, 1, 0, 1], dtype=torch.int32), torch.tensor([0, 2, 1, 3], dtype=torch.int32),
            torch.rand(tokens, slots))


@pytest.mark.parametrize("kw,name", [
    (dict(phases=True), "phases"),
    (dict(phases=2.0), "phases"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(swiglu_limit=0.0), "swiglu_limit"),
    (dict(swiglu_limit=float("nan")), "swiglu_limit"),
    (dict(swiglu_limit=float("inf")), "swiglu_limit"),
    (dict(swiglu_limit=True), "swiglu_limit"),
    (dict(swiglu_limit="10"), "swiglu_limit"),
])
def test_moe_fused_decode_rejects_bad_scalars(kw, name):
    from megamoe.ops.moe_fused_decode import moe_fused_decode

    kw = dict(dict(swiglu_limit=10.0), **kw)
    with pytest.raises((ValueError, TypeError), match=name):
        moe_fused_decode(*_fused_decode_args(), **kw)
