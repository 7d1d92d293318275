"""Fused decode route + dispatch (megamoe.ops.moe.route_dispatch) under its routing guarantee.

ids equal the float64 routing except where neighbouring keys (k-th vs (k+1)-th for the set, any two among the
first k+1 for the order) have overlapping float32 intervals (megamoe.reference.moe.routing_key_bounds); weights
within the propagated bound; the dispatch structures equal ops.moe.dispatch's on the returned ids, bit for bit.
"""
import pytest
import torch

from megamoe.ops import errors
from megamoe.ops import moe as moe_ops
from megamoe.reference import moe as ref
from sync_helpers import no_host_syncs


@pytest.fixture(autouse=True)
def _fused_at_every_size(monkeypatch):
    """These tests are about the fused launch: use it up to 64 tokens whatever the layer's default
    (``FUSED_ROUTE_MAX_TOKENS``, chosen from H100 timings); a test may set its own limit."""
    monkeypatch.setattr(moe_ops, "FUSED_ROUTE_MAX_TOKENS", 64)

U = 2.0 ** -24


def _check_guarantee(x, gate, bias, w, ids, k, scoring, scale=1.0, normalize=True):
    """Assert the documented guarantee; returns the number of tokens with a near-tie at the k boundary."""
    key, lo, hi = ref.routing_key_bounds(x, gate, bias, scoring)
    key = torch.nan_to_num(key, nan=float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    e = key.shape[1]
    kk = min(k + 1, e)
    top_lo = lo.gather(1, order[:, :kk])
    top_hi = hi.gather(1, order[:, :kk])
    near = top_lo[:, :-1] <= top_hi[:, 1:]  # neighbours j, j+1 may swap in float32
    boundary = near[:, k - 1] if kk > k else torch.zeros(key.shape[0], dtype=torch.bool)
    skipped = 0
    for t in range(key.shape[0]):
        if not torch.isfinite(key[t]).any():
            continue  # NaN token: checked separately
        if boundary[t]:
            skipped += 1
            continue
        assert sorted(ids[t].tolist()) == sorted(order[t, :k].tolist()), t
        for j in range(k):
            if (j == 0 or not near[t, j - 1]) and (j >= kk - 1 or not near[t, j]):
                assert ids[t, j].item() == order[t, j].item(), (t, j)
        # weights: float64 scores at the returned ids, within the propagated relative bound
        s64 = ref.router_scores(x[t:t + 1], gate, scoring, torch.float64)[0]
        bias64 = 0.0 if bias is None else bias.double()
        s_lo, s_hi = (lo[t] - bias64), (hi[t] - bias64)
        chosen = ids[t].long()
        rel = ((s_hi - s_lo)[chosen] / s64[chosen].abs().clamp_min(1e-300)).max().item()
        w64 = s64[chosen]
        if normalize:
            w64 = w64 / (w64.sum() + 1e-20)
        w64 = w64 * scale
        torch.testing.assert_close(w[t].double(), w64, rtol=2 * rel + (k + 8) * U, atol=1e-30)
    return skipped


def _dispatch_equal(d, ids, groups):
    want = moe_ops.dispatch(ids, groups, backend="torch")
    for name in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(d[name], want[name]), name


CASES = [  # tokens, experts, hidden, k, scoring
    (1, 16, 64, 3, "sqrtsoftplus"),
    (3, 24, 96, 6, "sigmoid"),
    (7, 40, 200, 4, "softmax"),
    (13, 64, 128, 6, "sqrtsoftplus"),  # T not a power of two
    (33, 32, 64, 2, "sqrtsoftplus"),
    (9, 20, 600, 6, "sqrtsoftplus"),  # with SPLIT_H_MIN_TOKENS 8: H splits, 2 expert blocks, ragged ones
]


@pytest.mark.parametrize("tokens,experts,hidden,k,scoring", CASES)
def test_fused_route_dispatch_guarantee(tokens, experts, hidden, k, scoring):
    x = torch.randn(tokens, hidden).bfloat16()
    gate = (torch.randn(experts, hidden) * hidden ** -0.5).bfloat16().float()
    bias = torch.rand(experts) * 0.1
    w, ids, d = moe_ops.route_dispatch(x, gate, bias, top_k=k, scoring_func=scoring, routed_scaling_factor=1.5)
    assert ids.shape == (tokens, k) and w.shape == (tokens, k) and ids.dtype == torch.int32
    skipped = _check_guarantee(x, gate, bias, w, ids, k, scoring, 1.5)
    assert skipped <= max(1, tokens // 4)  # near-ties are rare on random inputs
    _dispatch_equal(d, ids, experts)
    # the unfused path obeys the same guarantee (it is a float32 routing too)
    w2, ids2 = moe_ops.route(x, gate, bias, top_k=k, scoring_func=scoring, routed_scaling_factor=1.5)
    _check_guarantee(x, gate, bias, w2, ids2, k, scoring, 1.5)


@pytest.mark.parametrize("tokens,experts,hidden,k,scoring", [c for c in CASES if c[0] >= 8])
def test_fused_route_dispatch_guarantee_split_h(monkeypatch, tokens, experts, hidden, k, scoring):
    """The H-split GEMV plan (16-expert programs, partials, per-block tickets), used from SPLIT_H_MIN_TOKENS (64)
    tokens, forced here from 8 (the default before 2026-11-26)."""
    from megamoe.kernels import moe_route_dispatch

    monkeypatch.setattr(moe_route_dispatch, "SPLIT_H_MIN_TOKENS", 8)
    assert moe_route_dispatch.plan_route_dispatch(tokens, experts, hidden, 132)["BLOCK_E"] == 16
    test_fused_route_dispatch_guarantee(tokens, experts, hidden, k, scoring)


def test_guarantee_detects_a_wrong_selection():
    """The check can fail: swapping a chosen expert for the (k+2)-th one is caught."""
    torch.manual_seed(1)
    x = torch.randn(4, 64).bfloat16()
    gate = (torch.randn(16, 64) * 0.125).float()
    w, ids, _ = moe_ops.route_dispatch(x, gate, None, top_k=2, scoring_func="sigmoid")
    key = ref.routing_key_bounds(x, gate, None, "sigmoid")[0]
    bad = ids.clone()
    bad[:, 1] = torch.sort(key, dim=1, descending=True).indices[:, 3].int()
    with pytest.raises(AssertionError):
        _check_guarantee(x, gate, None, w, bad, 2, "sigmoid")


def test_exact_ties_lowest_index_and_bias():
    x = torch.zeros(5, 32).bfloat16()  # every logit 0: all scores equal -> pure ties
    x[3] = torch.randn(32).bfloat16()
    gate = torch.randn(16, 32) * 0.2
    bias = torch.zeros(16)
    bias[9] = bias[4] = 0.5
    w, ids, d = moe_ops.route_dispatch(x, gate, bias, top_k=4, scoring_func="sqrtsoftplus")
    for t in (0, 1, 2, 4):
        assert ids[t].tolist() == [4, 9, 0, 1]  # bias winners by index, then the lowest indices
        torch.testing.assert_close(w[t], torch.full((4,), 0.25))
    w_ref, ids_ref = moe_ops.route(x, gate, bias, top_k=4, scoring_func="sqrtsoftplus")
    assert torch.equal(ids[[0, 1, 2, 4]], ids_ref[[0, 1, 2, 4]])
    _dispatch_equal(d, ids, 16)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_nan_policy_same_as_torch_path(scoring):
    x = torch.randn(6, 48).bfloat16()
    x[2, 7] = float("nan")  # NaN hidden state: every logit NaN -> experts 0..k-1, NaN weights
    gate = torch.randn(20, 48) * 0.15
    gate[5, 3] = float("nan")  # expert 5's logit NaN for every token: never chosen (key -inf)...
    bias = torch.rand(20) * 0.05
    w, ids, d = moe_ops.route_dispatch(x, gate, bias, top_k=3, scoring_func=scoring)
    w_ref, ids_ref = moe_ops.route(x, gate, bias, top_k=3, scoring_func=scoring)
    assert ids[2].tolist() == [0, 1, 2] and torch.isnan(w[2]).all()
    if scoring == "softmax":  # ...except softmax: one NaN logit makes the whole row NaN -> 0..k-1 everywhere
        assert (ids == torch.arange(3, dtype=torch.int32)).all() and torch.isnan(w).all()
    else:
        assert not (ids[[0, 1, 3, 4, 5]] == 5).any() and torch.isfinite(w[[0, 1, 3, 4, 5]]).all()
    assert torch.equal(torch.isnan(w), torch.isnan(w_ref))
    rows = [t for t in range(6) if t != 2]
    if scoring != "softmax":
        # expert 5 (NaN logit) is out of the race: check the rest as a 19-expert router (ids above 5 shift down)
        keep = torch.arange(20) != 5
        _check_guarantee(x[rows], gate[keep], bias[keep], w[rows], ids[rows] - (ids[rows] > 5).int(), 3, scoring)
    assert torch.equal(ids[2], ids_ref[2])
    _dispatch_equal(d, ids, 20)


@pytest.mark.cuda
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("tokens", [6, 40])  # the fused route + dispatch launch, and the unfused router
def test_cuda_nan_policy_same_as_cpu(scoring, tokens, monkeypatch):
    """The NaN policy of test_nan_policy_same_as_torch_path on the GPU's compiled kernels (the interpreter's min/max
    propagate NaN, the GPU's plain min.f32 does not: sqrtsoftplus scored a NaN logit as sqrt(20))."""
    monkeypatch.setattr(moe_ops, "FUSED_ROUTE_MAX_TOKENS", 16)
    x = torch.randn(tokens, 48).bfloat16()
    x[2, 7] = float("nan")
    gate = torch.randn(20, 48) * 0.15
    gate[5, 3] = float("nan")
    bias = torch.rand(20) * 0.05
    w, ids, _ = moe_ops.route_dispatch(x.cuda(), gate.cuda(), bias.cuda(), top_k=3, scoring_func=scoring)
    w_cpu, ids_cpu, _ = moe_ops.route_dispatch(x, gate, bias, top_k=3, scoring_func=scoring)
    w, ids = w.cpu(), ids.cpu()
    assert ids[2].tolist() == [0, 1, 2] and torch.isnan(w[2]).all()
    assert torch.equal(torch.isnan(w), torch.isnan(w_cpu))
    if scoring != "softmax":
        rows = [t for t in range(tokens) if t != 2]
        assert not (ids[rows] == 5).any() and torch.isfinite(w[rows]).all()


def test_shared_slot_empty_experts_and_buffers():
    """Fused shared expert: column k preset to E, E+1 groups; 1 token leaves most experts empty."""
    e, k, h = 32, 6, 64
    gate = torch.randn(e, h) * 0.1
    bias = torch.rand(e) * 0.1
    for tokens in (1, 5):
        x = torch.randn(tokens, h).bfloat16()
        wb = torch.ones(8, k + 1)
        ib = torch.full((8, k + 1), e, dtype=torch.int32)
        bufs = {"expert_offsets": torch.full((e + 1,), -9, dtype=torch.int32),
                **{n: torch.full((8 * (k + 1),), -9, dtype=torch.int32) for n in
                   ("sorted_expert", "row_index", "inv_perm")}}
        w, ids, d = moe_ops.route_dispatch(x, gate, bias, top_k=k, num_groups=e + 1, slots=k + 1, out=(wb, ib),
                                           buffers=bufs)
        assert w.data_ptr() == wb.data_ptr() and d["inv_perm"].data_ptr() == bufs["inv_perm"].data_ptr()
        assert (ib[:tokens, k] == e).all() and (wb[:tokens, k] == 1).all()  # preset column untouched
        _dispatch_equal(d, ib[:tokens], e + 1)
        assert d["expert_offsets"][-1].item() == tokens * (k + 1)
        assert (d["sorted_expert"][-tokens:] == e).all()
        _check_guarantee(x, gate, bias, w, ids, k, "sqrtsoftplus")


def test_zero_tokens():
    gate = torch.randn(16, 32)
    x = torch.empty(0, 32).bfloat16()
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    assert torch.equal(d["expert_offsets"], torch.zeros(16, dtype=torch.int32))


def test_large_batch_takes_the_unfused_path(monkeypatch):
    monkeypatch.setattr(moe_ops, "FUSED_ROUTE_MAX_TOKENS", 2)
    x = torch.randn(5, 32).bfloat16()
    gate = torch.randn(16, 32) * 0.2
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=3)
    w_ref, ids_ref = moe_ops.route(x, gate, None, top_k=3)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)  # the route() path exactly
    _dispatch_equal(d, ids, 16)


def test_hash_routing_and_flags():
    e, k, h, vocab = 16, 3, 48, 10
    table = torch.stack([torch.randperm(e)[:k] for _ in range(vocab)]).int()
    table[4, 1] = e + 3  # an out-of-range entry
    gate = torch.randn(e, h) * 0.2
    x = torch.randn(6, h).bfloat16()
    tok = torch.tensor([0, 4, 2, vocab + 5, 9, 2])
    errors.clear_errors("cpu")
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=k, token_ids=tok, tid2eid=table,
                                       routed_scaling_factor=2.5)
    flags = errors.decode(errors.peek_errors("cpu"))
    errors.clear_errors("cpu")
    assert ("route", "token_ids") in flags and ("route", "tid2eid") in flags
    for t in (0, 2, 4, 5):
        assert torch.equal(ids[t], table[tok[t]])
    for t in (1, 3):  # invalid rows: ids 0..k-1, NaN weights
        assert ids[t].tolist() == [0, 1, 2] and torch.isnan(w[t]).all()
    w_ref, ids_ref = moe_ops.route(x, gate, None, top_k=k, token_ids=tok, tid2eid=table, routed_scaling_factor=2.5)
    errors.clear_errors("cpu")
    assert torch.equal(ids, ids_ref)
    ok = [0, 2, 4, 5]
    s64 = ref.router_scores(x[ok], gate, "sqrtsoftplus", torch.float64).gather(1, ids[ok].long())
    w64 = s64 / s64.sum(1, keepdim=True) * 2.5
    torch.testing.assert_close(w[ok].double(), w64, rtol=1e-5, atol=0)
    _dispatch_equal(d, ids, e)


def test_preset_id_out_of_range_is_dropped_and_flagged():
    e, k = 16, 2
    x = torch.randn(3, 32).bfloat16()
    gate = torch.randn(e, 32) * 0.2
    ib = torch.full((3, k + 1), e, dtype=torch.int32)
    ib[1, k] = e + 7  # bad preset id
    errors.clear_errors("cpu")
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=k, num_groups=e + 1, slots=k + 1,
                                       out=(torch.empty(3, k + 1), ib))
    assert ("dispatch", "topk_ids") in errors.decode(errors.peek_errors("cpu"))
    errors.clear_errors("cpu")
    _dispatch_equal(d, ib, e + 1)
    errors.clear_errors("cpu")


def test_route_dispatch_rejects_bad_arguments():
    x = torch.randn(2, 32).bfloat16()
    gate = torch.randn(16, 32)
    with pytest.raises(ValueError, match="slots"):
        moe_ops.route_dispatch(x, gate, None, top_k=3, slots=2)
    with pytest.raises(ValueError, match="out"):
        moe_ops.route_dispatch(x, gate, None, top_k=3, slots=4)
    with pytest.raises(ValueError, match="num_groups"):
        moe_ops.route_dispatch(x, gate, None, top_k=3, num_groups=8)
    with pytest.raises(ValueError, match="dispatch_backend"):
        moe_ops.route_dispatch(x, gate, None, top_k=3, dispatch_backend="cuda")
    with pytest.raises(ValueError, match="hidden_states"):
        moe_ops.route_dispatch(torch.randn(2, 31).bfloat16(), gate, None, top_k=3)
    with pytest.raises(ValueError, match="backend"):
        moe_ops.route_dispatch(x, gate, None, top_k=3, backend="cuda")


# ---------------------------------------------------------------------------------------------- CUDA (lead)
V4_SHAPES = [(256, 4096, 6, "v4-flash"), (384, 7168, 6, "v4-pro")]


@pytest.mark.parametrize("block_e", [2, 4])
@pytest.mark.parametrize("tokens,experts,hidden,k,scoring", [c for c in CASES if c[0] <= 32])  # T_PAD < 64
def test_fused_route_dispatch_guarantee_several_experts_per_program(monkeypatch, block_e, tokens, experts, hidden, k,
                                                                     scoring):
    """Below SPLIT_H_MIN_TOKENS with SMALL_T_BLOCK_E experts per GEMV program (whole rows of H, no partials)."""
    from megamoe.kernels import moe_route_dispatch

    monkeypatch.setattr(moe_route_dispatch, "SMALL_T_BLOCK_E", block_e)
    plan = moe_route_dispatch.plan_route_dispatch(tokens, experts, hidden, 132)
    assert plan["BLOCK_E"] == block_e and plan["splits"] == 1
    test_fused_route_dispatch_guarantee(tokens, experts, hidden, k, scoring)


@pytest.mark.cuda
@pytest.mark.parametrize("experts,hidden,k,name", V4_SHAPES)
@pytest.mark.parametrize("tokens", [1, 4, 8, 37, 64])
@pytest.mark.parametrize("block_e", [None, 4])
def test_cuda_fused_route_dispatch_v4_shapes(monkeypatch, experts, hidden, k, name, tokens, block_e):
    if block_e is not None:  # several experts per GEMV program (moe_route_dispatch.SMALL_T_BLOCK_E)
        from megamoe.kernels import moe_route_dispatch

        monkeypatch.setattr(moe_route_dispatch, "SMALL_T_BLOCK_E", block_e)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
    gate = (torch.randn(experts, hidden, device=dev, generator=gen) * hidden ** -0.5).bfloat16().float()
    bias = torch.rand(experts, device=dev, generator=gen) * 0.1
    kw = dict(top_k=k, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_groups=experts + 1,
              slots=k + 1)
    wb = torch.ones(tokens, k + 1, device=dev)
    ib = torch.full((tokens, k + 1), experts, dtype=torch.int32, device=dev)
    bufs = {"expert_offsets": torch.empty(experts + 1, dtype=torch.int32, device=dev),
            **{n: torch.empty(tokens * (k + 1), dtype=torch.int32, device=dev) for n in
               ("sorted_expert", "row_index", "inv_perm")}}
    moe_ops.route_dispatch(x, gate, bias, out=(wb, ib), buffers=bufs, **kw)  # compile + counters
    torch.cuda.synchronize()
    with no_host_syncs():
        w, ids, d = moe_ops.route_dispatch(x, gate, bias, out=(wb, ib), buffers=bufs, **kw)
    eager = (w.clone(), ids.clone(), {n: t.clone() for n, t in d.items()})
    _check_guarantee(x.cpu(), gate.cpu(), bias.cpu(), eager[0].cpu(), eager[1].cpu(), k, "sqrtsoftplus", 1.5)
    _dispatch_equal({n: t.cpu() for n, t in eager[2].items()}, ib.cpu(), experts + 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_ops.route_dispatch(x, gate, bias, out=(wb, ib), buffers=bufs, **kw)
    for _ in range(3):  # counters self-reset: replays and eager calls interleave
        wb.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(w, eager[0]) and torch.equal(ids, eager[1])  # deterministic: same bits
        for n in eager[2]:
            assert torch.equal(d[n], eager[2][n]), n
        moe_ops.route_dispatch(x, gate, bias, out=(wb, ib), buffers=bufs, **kw)
    from megamoe.kernels.moe_route_dispatch import route_dispatch_counters

    assert int(route_dispatch_counters(dev).abs().sum()) == 0


@pytest.mark.cuda
def test_cuda_hash_layer_shape_graph():
    dev, e, h, k, vocab = "cuda", 256, 4096, 6, 1000
    table = torch.rand(vocab, e, device=dev).topk(k, dim=1).indices.int()
    gate = (torch.randn(e, h, device=dev) * h ** -0.5).float()
    x = torch.randn(8, h, device=dev).bfloat16()
    tok = torch.randint(0, vocab, (8,), device=dev)
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=k, token_ids=tok, tid2eid=table)
    assert torch.equal(ids, table[tok])
    _dispatch_equal({n: t.cpu() for n, t in d.items()}, ids.cpu(), e)


@pytest.mark.parametrize("tokens,hidden,fused_max", [(1, 64, 64), (5, 600, 64), (9, 96, 64), (3, 64, 0)])
def test_x_paired_out_is_the_paired_copy(monkeypatch, tokens, hidden, fused_max):
    """``x_paired_out`` receives the hidden states in the paired order on the fused launch (interpreter; ragged H
    chunks at 600) and on the unfused path (FUSED_ROUTE_MAX_TOKENS 0), rows past T untouched, routing unchanged."""
    from megamoe.format.mma_order import to_paired_order

    monkeypatch.setattr(moe_ops, "FUSED_ROUTE_MAX_TOKENS", fused_max)
    x = torch.randn(tokens, hidden).bfloat16()
    x[0, 5] = float("nan")
    gate = torch.randn(16, hidden) * hidden ** -0.5
    buf = torch.full((tokens + 2, hidden), 7.0, dtype=torch.bfloat16)
    w, ids, d = moe_ops.route_dispatch(x, gate, None, top_k=3, x_paired_out=buf)
    w0, ids0, d0 = moe_ops.route_dispatch(x, gate, None, top_k=3)
    assert torch.equal(buf[:tokens].view(torch.int16), to_paired_order(x).view(torch.int16))  # NaN bits too
    assert (buf[tokens:] == 7.0).all()
    assert torch.equal(ids, ids0) and torch.equal(w.nan_to_num(), w0.nan_to_num())


def test_x_paired_out_is_checked():
    x = torch.randn(2, 64).bfloat16()
    gate = torch.randn(16, 64)
    for bad in (torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16),
                torch.empty(2, 64), torch.empty(2, 128, dtype=torch.bfloat16)[:, :64]):
        with pytest.raises(ValueError, match="x_paired_out"):
            moe_ops.route_dispatch(x, gate, None, top_k=2, x_paired_out=bad)
    with pytest.raises(TypeError, match="x_paired_out"):
        moe_ops.route_dispatch(x, gate, None, top_k=2, x_paired_out="buffer")
    with pytest.raises(ValueError, match="x_paired_out"):  # H not a multiple of 8
        moe_ops.route_dispatch(torch.randn(2, 60).bfloat16(), torch.randn(16, 60), None, top_k=2,
                               x_paired_out=torch.empty(2, 60, dtype=torch.bfloat16))
