"""Router, dispatch and combine ops (megamoe/ops/moe.py) vs brute-force oracles."""
import math

import pytest
import torch

from megamoe.ops import moe as moe_ops
from megamoe.reference import moe as moe_ref


def score_oracle(row, scoring: str) -> list:
    """Python scores of one token's router logits (sigmoid, softmax or sqrt(softplus))."""
    if scoring == "sigmoid":
        return [1 / (1 + math.exp(-v)) for v in row]
    if scoring == "softmax":
        m = max(row)
        z = sum(math.exp(v - m) for v in row)
        return [math.exp(v - m) / z for v in row]
    return [math.sqrt(math.log1p(math.exp(v))) for v in row]


def _brute_route(x, gate, bias, top_k, scoring, n_group=1, topk_group=1, norm=True, scale=1.0):
    """Per-token Python oracle with the documented tie-break (lower expert index wins)."""
    logits = (x.float() @ gate.float().t()).tolist()
    num_experts = gate.shape[0]
    ids, weights = [], []
    for row in logits:
        s = score_oracle(row, scoring)
        key = [si + (bias[e].item() if bias is not None else 0.0) for e, si in enumerate(s)]
        allowed = set(range(num_experts))
        if n_group > 1:
            size = num_experts // n_group
            gscore = [sum(sorted(key[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
            groups = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            allowed = {e for g in groups for e in range(g * size, (g + 1) * size)}
        order = sorted(allowed, key=lambda e: (-key[e], e))[:top_k]
        w = [s[e] for e in order]
        if norm:
            tot = sum(w)
            w = [v / tot for v in w]
        ids.append(order)
        weights.append([v * scale for v in w])
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_route_matches_oracle(scoring, groups):
    t, h, e, k = 7, 32, 16, 3
    x = torch.randn(t, h).bfloat16()
    gate = torch.randn(e, h).bfloat16() * 0.3
    bias = torch.rand(e) * 0.05
    w, ids = moe_ops.route(x, gate, bias, top_k=k, scoring_func=scoring, n_group=groups[0],
                           topk_group=groups[1], routed_scaling_factor=1.5)
    w_ref, ids_ref = _brute_route(x, gate, bias, k, scoring, *groups, scale=1.5)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_route_ties_pick_lowest_index_and_bias_only_selects():
    x = torch.randn(3, 16).bfloat16()
    gate = torch.zeros(8, 16).bfloat16()  # every score equal: pure ties
    w, ids = moe_ops.route(x, gate, None, top_k=3, scoring_func="sigmoid", norm_topk_prob=False)
    assert ids.tolist() == [[0, 1, 2]] * 3
    bias = torch.zeros(8)
    bias[5] = 1.0  # selection prefers 5, but its weight stays the unbiased score
    w, ids = moe_ops.route(x, gate, bias, top_k=2, scoring_func="sigmoid", norm_topk_prob=False)
    assert ids.tolist() == [[5, 0]] * 3
    torch.testing.assert_close(w, torch.full((3, 2), 0.5))


def test_route_nan_token_is_isolated():
    x = torch.randn(4, 16).bfloat16()
    x[2, 3] = float("nan")
    gate = torch.randn(8, 16).bfloat16()
    w, ids = moe_ops.route(x, gate, torch.zeros(8), top_k=2)
    assert ids[2].tolist() == [0, 1] and torch.isnan(w[2]).all()
    keep = [0, 1, 3]
    w2, ids2 = moe_ops.route(x[keep], gate, torch.zeros(8), top_k=2)
    assert torch.equal(ids[keep], ids2)  # (a 3-row GEMM may round differently from a 4-row one: weights ~ulp)
    torch.testing.assert_close(w[keep], w2, rtol=1e-5, atol=0)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_scores_do_not_depend_on_the_batch(scoring):
    """A token's scores are the same bits in every slice of the batch that holds it. Expert parallelism splits a
    batch over ranks and must route each token as the single-process layer does; ATen's CPU float32 sigmoid and
    softplus give a tensor's vectorised body and its scalar tail other last bits (E = 8: 341 of these slices
    differed for sqrt(softplus) when the scores were float32)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 8, generator=g) * 4
    full = moe_ref.score_function(logits, scoring)
    assert full.dtype == torch.float32
    for lo in range(24):
        for hi in range(lo + 1, 25):
            assert torch.equal(moe_ref.score_function(logits[lo:hi], scoring), full[lo:hi]), (lo, hi)


def test_route_rejects_bad_arguments():
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(ValueError, match="hidden_states"):
        moe_ops.route(x, torch.randn(8, 32), None, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        moe_ops.route(x, torch.randn(8, 16), None, top_k=9)
    with pytest.raises(TypeError, match="correction_bias"):
        moe_ops.route(x, torch.randn(8, 16), torch.zeros(8, dtype=torch.int32), top_k=2)


@pytest.mark.parametrize("case", ["random", "one_expert", "empty_experts", "no_tokens"])
def test_dispatch(case):
    e, k = 8, 2
    if case == "random":
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(13)]).int()
    elif case == "one_expert":
        ids = torch.full((6, 1), 3, dtype=torch.int32)
    elif case == "empty_experts":
        ids = torch.tensor([[7, 2]], dtype=torch.int32)
    else:
        ids = torch.empty((0, k), dtype=torch.int32)
    d = moe_ops.dispatch(ids, e)
    offsets, perm, row_index = moe_ref.dispatch(ids, e)
    assert torch.equal(d["expert_offsets"], offsets) and torch.equal(d["row_index"], row_index)
    kk = ids.shape[1]
    pairs = torch.arange(ids.numel())
    inv = d["inv_perm"].long()
    assert torch.equal(d["sorted_expert"][inv], ids.reshape(-1))  # pair p lands in a row of its expert
    assert torch.equal(d["row_index"][inv].long(), pairs // kk)  # ... and that row reads its token
    assert torch.equal(torch.sort(inv).values, pairs)  # a permutation


@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_combine_kernel_matches_torch(with_shared, tokens):
    k, h = 3, 80  # h not a multiple of the interpreter's BLOCK_H
    y = torch.randn(tokens * k + 2, h).bfloat16()
    inv = torch.randperm(tokens * k).int()
    w = torch.rand(tokens, k)
    shared = torch.randn(tokens, h).bfloat16() if with_shared else None
    out = moe_ops.combine(y, inv, w, shared)
    ref = (shared.float() if with_shared else torch.zeros(tokens, h))
    for j in range(k):
        ref = ref + w[:, j:j + 1] * y[inv.view(tokens, k)[:, j].long()].float()
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("tokens,k,e", [(5, 2, 8), (40, 3, 8), (73, 7, 385), (37, 6, 256), (1, 3, 4)])
def test_dispatch_triton_above_the_sort_limit_runs_the_blocked_kernels(monkeypatch, tokens, k, e, block, device):
    """backend="triton" with more pairs than the one-program sort holds: the blocked kernels (two launches of
    ``block`` pairs per program), the torch path's values bit for bit (int32): pair counts that are not a multiple of
    the block, one block, E not a power of two, empty experts, and dropped ids (outside [0, E), flagged)."""
    from megamoe.kernels import moe_dispatch
    from megamoe.ops import errors

    monkeypatch.setattr(moe_ops, "DISPATCH_SORT_MAX_PAIRS", 0)
    monkeypatch.setattr(moe_dispatch, "DISPATCH_BLOCK", block)
    ids = torch.stack([torch.randperm(e - 1 if e > 8 else e)[:k] for _ in range(tokens)]).to(device)  # int64
    if tokens > 2:
        ids[1, 0], ids[-1, -1] = e + 2, -1  # dropped pairs
    errors.clear_errors(ids.device)
    got = moe_ops.dispatch(ids, e, backend="triton")
    flagged = errors.decode(errors.peek_errors(ids.device))
    errors.clear_errors(ids.device)
    want = moe_ops.dispatch(ids, e, backend="torch")
    errors.clear_errors(ids.device)
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(got[key].long(), want[key].long()), key
    assert got["sorted_expert"].dtype == torch.int32
    assert flagged == ([("dispatch", "topk_ids")] if tokens > 2 else [])


@pytest.mark.parametrize("tokens,k,e", [(1, 6, 257), (5, 2, 8), (40, 3, 8), (33, 1, 4), (73, 7, 385),
                                         (300, 7, 257)])
def test_dispatch_triton_kernel_equals_torch_path(tokens, k, e, device):
    # pair counts not a power of two (120, 511, 2100: the sort's padding lanes), E+1 groups with an empty last
    # group, k = 1, 8 warps from 1025 pairs
    ids = torch.stack([torch.randperm(e - 1 if e > 8 else e)[:k] for _ in range(tokens)]).int().to(device)
    ref = moe_ops.dispatch(ids, e, backend="torch")
    got = moe_ops.dispatch(ids, e, backend="triton")
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(got[key], ref[key]), key


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("experts,k", [(16, 3), (257, 6)])
def test_route_triton_kernel_matches_torch(scoring, experts, k, device):
    x = torch.randn(9, 32).bfloat16().to(device)
    x[4, 1] = float("nan")  # NaN policy: ids 0..k-1, NaN weights
    gate = (torch.randn(experts, 32) * 0.3).bfloat16().to(device)
    bias = (torch.rand(experts) * 0.05).to(device)
    bias[3] = bias[7] = 0.5  # plus exact ties in the keys of rows with equal scores
    x[6] = 0  # all logits 0: all scores equal, keys tie except the bias
    kw = dict(top_k=k, scoring_func=scoring, routed_scaling_factor=1.5)
    w_ref, ids_ref = moe_ops.route(x, gate, bias, **kw)
    wb = torch.full((9, k + 1), -7.0, device=device)
    ib = torch.full((9, k + 1), -7, dtype=torch.int32, device=device)
    w, ids = moe_ops.route(x, gate, bias, backend="triton", out=(wb, ib), **kw)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-7, atol=0, equal_nan=True)
    assert (ib[:, k] == -7).all() and (wb[:, k] == -7).all()  # the extra column is left alone
    assert ids[6, :2].tolist() == [3, 7]


@pytest.mark.parametrize("experts,k,n_group,topk_group", [(64, 6, 8, 3), (256, 8, 8, 4), (16, 4, 16, 5), (32, 2, 2, 1)])
def test_route_triton_kernel_group_limited_matches_torch(experts, k, n_group, topk_group, device):
    x = torch.randn(11, 32).bfloat16().to(device)
    x[2, 5] = float("nan")  # NaN policy unchanged with groups
    gate = (torch.randn(experts, 32) * 0.3).bfloat16().to(device)
    bias = (torch.rand(experts // n_group) * 0.05).repeat(n_group).to(device)  # same bias in every group
    x[7] = 0  # all scores equal: every group key ties -> the lowest groups win
    kw = dict(top_k=k, scoring_func="sigmoid", n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    w_ref, ids_ref = moe_ops.route(x, gate, bias, **kw)
    w, ids = moe_ops.route(x, gate, bias, backend="triton", **kw)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-7, atol=0, equal_nan=True)
    w_brute, ids_brute = _brute_route(x.cpu(), gate.cpu(), bias.cpu(), k, "sigmoid", n_group, topk_group, True, 2.5)
    finite_rows = [t for t in range(x.shape[0]) if t != 2]
    assert torch.equal(ids.cpu()[finite_rows], ids_brute[finite_rows])
    # the selected experts lie in at most topk_group groups
    size = experts // n_group
    assert max(len(set((ids[t] // size).tolist())) for t in range(ids.shape[0])) <= topk_group
    assert set((ids[7] // size).tolist()) <= set(range(topk_group))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,k,e", [(4096, 6, 256), (16384, 7, 385), (2925, 7, 257)])
def test_cuda_blocked_dispatch_graph_sync_free_equals_torch(tokens, k, e):
    """Prefill sizes (blocked kernels on the GPU): the torch path's values, with dropped ids; sync-free; a graph
    replay after the ids changed in place (a hot expert) equals an eager call."""
    from sync_helpers import no_host_syncs

    dev = torch.device("cuda")
    ids = torch.randint(0, e, (tokens, k), dtype=torch.int32, device=dev)
    ids[7, 0], ids[-1, 1] = e, -3
    bufs = {"expert_offsets": torch.empty(e, dtype=torch.int32, device=dev)}
    for name in ("sorted_expert", "row_index", "inv_perm"):
        bufs[name] = torch.empty(tokens * k, dtype=torch.int32, device=dev)
    want = moe_ops.dispatch(ids, e, backend="torch")
    torch.cuda.synchronize()
    with no_host_syncs():
        got = moe_ops.dispatch(ids, e, buffers=bufs, backend="triton")
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(got[key].long(), want[key].long()), key
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_ops.dispatch(ids, e, buffers=bufs, backend="triton")
    ids.copy_(torch.where(torch.rand(tokens, k, device=dev) < 0.5, 3, ids))  # expert 3 hot (repeats in a row allowed)
    graph.replay()
    torch.cuda.synchronize()
    replayed = {key: bufs[key].clone() for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm")}
    want = moe_ops.dispatch(ids, e, backend="torch")
    for key in replayed:
        assert torch.equal(replayed[key].long(), want[key].long()), key
    from megamoe.ops import errors
    errors.clear_errors(dev)


@pytest.mark.parametrize("pairs_limit", [4096, 0])  # the one-program sort, the blocked kernels
def test_dispatch_triton_int64_ids_beyond_int32_are_dropped_not_wrapped(monkeypatch, pairs_limit, device):
    """An int64 id of 2**32 + 1 is out of range (dropped into the padding rows, flagged) on the Triton path as on the
    torch path, not read as expert 1 after a cast to int32."""
    from megamoe.ops import errors

    monkeypatch.setattr(moe_ops, "DISPATCH_SORT_MAX_PAIRS", pairs_limit)
    ids = torch.tensor([[0, 2 ** 32 + 1], [1, 3], [-(2 ** 40), 2]], dtype=torch.int64, device=device)
    errors.clear_errors(ids.device)
    got = moe_ops.dispatch(ids, 4, backend="triton")
    assert errors.decode(errors.peek_errors(ids.device)) == [("dispatch", "topk_ids")]
    errors.clear_errors(ids.device)
    want = moe_ops.dispatch(ids, 4, backend="torch")
    errors.clear_errors(ids.device)
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(got[key].long(), want[key].long()), key
    assert int(got["expert_offsets"][-1]) == 4  # the two out-of-range pairs sit past the last expert
