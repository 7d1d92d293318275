"""Hash routing (DeepSeek-V4's first layers) in megamoe.ops.moe.route: reference vs a Python oracle, the Triton
kernel vs the torch path, the invalid-input policy, validation, and the sm_90 build of the kernel."""

import pytest
import torch

from megamoe.ops import moe as moe_ops
from megamoe.reference import moe as moe_ref

from test_moe_ops import score_oracle  # noqa: E402  (tests/ops is on sys.path under pytest's rootdir-based import)
from sync_helpers import no_host_syncs
from guard_helpers import set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)


def _oracle(x, gate, table, tokens, scoring, norm, scale):
    """Per-token Python oracle of the documented hash-routing rules."""
    logits = (x.float() @ gate.float().t()).tolist()
    vocab, k = table.shape
    num_experts = gate.shape[0]
    ws, ids = [], []
    for row, tok in zip(logits, tokens.tolist()):
        s = score_oracle(row, scoring)
        entry = table[tok].tolist() if 0 <= tok < vocab else None
        if entry is None or not all(0 <= e < num_experts for e in entry):
            ids.append(list(range(k)))
            ws.append([float("nan")] * k)
            continue
        w = [s[e] for e in entry]
        if norm:
            tot = sum(w)
            w = [v / tot for v in w]
        ids.append(entry)
        ws.append([v * scale for v in w])
    return torch.tensor(ws), torch.tensor(ids, dtype=torch.int32)


def _table(vocab, experts, k, device="cpu"):
    return torch.rand(vocab, experts).topk(k, dim=1).indices.int().to(device)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_hash_route_matches_oracle(scoring, norm):
    t, h, e, k, vocab = 9, 32, 16, 3, 40
    x = torch.randn(t, h).bfloat16()
    gate = (torch.randn(e, h) * 0.3).bfloat16()
    table = _table(vocab, e, k)
    tokens = torch.randint(0, vocab, (t,))
    w, ids = moe_ops.route(x, gate, None, top_k=k, scoring_func=scoring, norm_topk_prob=norm,
                           routed_scaling_factor=2.5, token_ids=tokens, tid2eid=table)
    w_ref, ids_ref = _oracle(x, gate, table, tokens, scoring, norm, 2.5)
    assert torch.equal(ids, ids_ref) and torch.equal(ids, table[tokens])
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    # the ids ignore the hidden states (no data-dependent selection): other states, same ids
    _, ids2 = moe_ops.route(torch.randn(t, h).bfloat16(), gate, None, top_k=k, token_ids=tokens, tid2eid=table)
    assert torch.equal(ids2, ids)


def _invalid_inputs(device, vocab=30, e=16, k=4, t=8):
    x = torch.randn(t, 32).bfloat16()
    x[6, 0] = float("nan")  # NaN state: table ids kept, NaN weights
    table = _table(vocab, e, k)
    tokens = torch.randperm(vocab)[:t]  # distinct ids: the rows made invalid below share no id with the good ones
    tokens[1], tokens[2] = vocab, -3  # out of the vocabulary
    table[tokens[4]] = torch.tensor([2, e, 1, 0], dtype=torch.int32)  # an entry out of [0, E)
    table[tokens[5]] = torch.tensor([3, 1, -1, 0], dtype=torch.int32)
    tokens[7] = tokens[0]
    gate = (torch.randn(e, 32) * 0.3).bfloat16()
    return x.to(device), gate.to(device), table.to(device), tokens.to(device)


@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32])
def test_invalid_token_ids_and_entries_follow_the_policy(token_dtype):
    x, gate, table, tokens = _invalid_inputs("cpu")
    k = table.shape[1]
    w, ids = moe_ops.route(x, gate, None, top_k=k, token_ids=tokens.to(token_dtype), tid2eid=table)
    for row in (1, 2, 4, 5):
        assert ids[row].tolist() == list(range(k)) and torch.isnan(w[row]).all()
    assert torch.equal(ids[6], table[tokens[6]]) and torch.isnan(w[6]).all()
    good = [0, 3, 7]
    assert torch.isfinite(w[good]).all() and torch.equal(ids[good], table[tokens[good]])
    assert torch.equal(ids[7], ids[0])  # same token id, same experts (whatever the hidden state)


@pytest.mark.parametrize("experts,k,scoring", [(16, 4, "sqrtsoftplus"), (257, 6, "sigmoid"), (8, 1, "softmax")])
def test_triton_kernel_matches_torch(experts, k, scoring, device):
    t, vocab = 11, 37
    x = torch.randn(t, 32).bfloat16().to(device)
    x[3, 2] = float("nan")
    gate = (torch.randn(experts, 32) * 0.3).bfloat16().to(device)
    table = _table(vocab, experts, k, device)
    tokens = torch.randint(0, vocab, (t,)).to(device)
    tokens[5] = vocab + 100
    kw = dict(top_k=k, scoring_func=scoring, routed_scaling_factor=1.5, token_ids=tokens, tid2eid=table)
    w_ref, ids_ref = moe_ops.route(x, gate, None, **kw)
    wb = torch.full((t + 2, k + 1), -7.0, device=device)
    ib = torch.full((t + 2, k + 1), -7, dtype=torch.int32, device=device)
    w, ids = moe_ops.route(x, gate, None, backend="triton", out=(wb, ib), **kw)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-7, atol=0, equal_nan=True)
    assert (ib[:, k] == -7).all() and (wb[t:] == -7).all()  # extra column / rows left alone


def test_triton_kernel_invalid_policy(device):
    x, gate, table, tokens = _invalid_inputs(device)
    k = table.shape[1]
    ref = moe_ops.route(x, gate, None, top_k=k, token_ids=tokens, tid2eid=table)
    got = moe_ops.route(x, gate, None, top_k=k, token_ids=tokens.int(), tid2eid=table, backend="triton")
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0], rtol=4e-7, atol=0, equal_nan=True)
    # a strided (non-contiguous rows) table view is accepted
    wide = torch.zeros(table.shape[0], k + 3, dtype=torch.int32, device=device)
    wide[:, :k] = table
    got2 = moe_ops.route(x, gate, None, top_k=k, token_ids=tokens, tid2eid=wide[:, :k], backend="triton")
    assert torch.equal(got2[1], ref[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_invalid_token_ids_and_entries_are_flagged(backend, monkeypatch):
    """Issue 12: a token id outside [0, V) sets ("route", "token_ids"), a table entry outside [0, E) of a valid
    token's row sets ("route", "tid2eid"), on both backends; valid inputs set nothing and give the same outputs."""
    from megamoe.ops import errors

    set_interpret(monkeypatch, "1")
    x, gate, table, tokens = _invalid_inputs("cpu")
    k, vocab = table.shape[1], table.shape[0]
    kw = dict(top_k=k, tid2eid=table, backend=backend)
    errors.clear_errors("cpu")
    good = moe_ops.route(x, gate, None, token_ids=tokens.clamp(0, vocab - 1), **{**kw, "tid2eid": table.clamp(0, 15)})
    assert errors.peek_errors("cpu") == 0
    ref = moe_ops.route(x, gate, None, token_ids=tokens.clamp(0, vocab - 1), top_k=k, tid2eid=table.clamp(0, 15))
    assert torch.equal(good[1], ref[1])
    cases = [([1], errors.flag("route", "token_ids")), ([2], errors.flag("route", "token_ids")),
             ([4], errors.flag("route", "tid2eid")), ([5], errors.flag("route", "tid2eid")),
             ([1, 2, 4, 5], errors.flag("route", "token_ids") | errors.flag("route", "tid2eid"))]
    for rows, expected in cases:
        t = tokens.clone()
        keep = [r for r in (1, 2, 4, 5) if r not in rows]
        t[keep] = tokens[0]                                          # only the listed rows stay invalid
        errors.clear_errors("cpu")
        moe_ops.route(x, gate, None, token_ids=t.int(), **kw)
        assert errors.peek_errors("cpu") == expected, (rows, backend)
    with pytest.raises(errors.DeviceIndexError, match="route: argument 'token_ids'.*route: argument 'tid2eid'"):
        errors.check_errors("cpu")


def test_reference_is_the_op_torch_path():
    x, gate, table, tokens = _invalid_inputs("cpu")
    k = table.shape[1]
    a = moe_ref.hash_route(x, gate, table, tokens, routed_scaling_factor=1.5)
    b = moe_ops.route(x, gate, None, top_k=k, token_ids=tokens, tid2eid=table, routed_scaling_factor=1.5)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].nan_to_num(-1), b[0].nan_to_num(-1))


def test_hash_route_validation():
    x = torch.randn(3, 16).bfloat16()
    gate = torch.randn(8, 16)
    table = _table(10, 8, 2)
    tok = torch.tensor([1, 2, 3])
    kw = dict(top_k=2)
    with pytest.raises(ValueError, match="token_ids"):
        moe_ops.route(x, gate, None, tid2eid=table, **kw)
    with pytest.raises(ValueError, match="token_ids"):
        moe_ops.route(x, gate, None, token_ids=tok, **kw)  # ids without a table
    with pytest.raises(TypeError, match="tid2eid"):
        moe_ops.route(x, gate, None, token_ids=tok, tid2eid=table.long(), **kw)
    with pytest.raises(ValueError, match="tid2eid"):
        moe_ops.route(x, gate, None, token_ids=tok, tid2eid=table[:, :1], **kw)
    with pytest.raises(TypeError, match="token_ids"):
        moe_ops.route(x, gate, None, token_ids=tok.float(), tid2eid=table, **kw)
    with pytest.raises(ValueError, match="token_ids"):
        moe_ops.route(x, gate, None, token_ids=tok[:2], tid2eid=table, **kw)
    with pytest.raises(ValueError, match="correction_bias"):
        moe_ops.route(x, gate, torch.zeros(8), token_ids=tok, tid2eid=table, **kw)
    moe_ops.check_tid2eid(table, 8, 2, vocab_size=10)
    for bad_id in (8, -1):  # one entry out of range (a random table + 1 need not reach 8: flaky)
        bad = table.clone()
        bad[3, 1] = bad_id
        with pytest.raises(ValueError, match=r"\[0, 8\)"):
            moe_ops.check_tid2eid(bad, 8, 2)
    with pytest.raises(ValueError, match="vocab"):
        moe_ops.check_tid2eid(table, 8, 2, vocab_size=11)
    with pytest.raises(TypeError, match="int32"):
        moe_ops.check_tid2eid(table.long(), 8, 2)


def test_hash_kernel_builds_for_sm90():
    from sm90_compile import compile_sm90

    sig = dict(scores_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32", num_experts="i32",
               stride_s="i32", stride_w="i32", stride_i="i32", routed_scaling_factor="fp32", token_ids_ptr="*i64",
               tid2eid_ptr="*i32", vocab="i32", stride_t="i32", err_ptr="*i32")
    for hashed in (True, False):
        consts = dict(TOP_K=6, K_PAD=8, E_PAD=512, HAS_BIAS=not hashed, NORMALIZE=True, N_GROUP=1, TOPK_GROUP=1,
                      HASH=hashed, FLAG_TOKENS=(1 << 18) if hashed else 0, FLAG_TABLE=(1 << 19) if hashed else 0)
        ptx, res = compile_sm90("megamoe.kernels.moe_router", "_moe_topk_kernel", sig, consts, 1 if hashed else 4)
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res  # no spills
        if hashed:  # the hash path is a handful of loads: no selection loop over E
            assert res["REG"] <= 32 and res["SASS"] < 200, res
        assert "ld.global" in ptx


@pytest.mark.cuda
def test_cuda_hash_route_sync_free_and_graph():
    t, e, k, vocab = 64, 256, 6, 129280  # V4-Flash router shapes
    x = torch.randn(t, 4096, device="cuda").bfloat16()
    gate = (torch.randn(e, 4096, device="cuda") * 4096 ** -0.5)
    table = torch.rand(vocab, e, device="cuda").topk(k, dim=1).indices.int()
    tokens = torch.randint(0, vocab, (t,), device="cuda")
    out = (torch.empty(t, k, device="cuda"), torch.empty(t, k, dtype=torch.int32, device="cuda"))
    kw = dict(top_k=k, routed_scaling_factor=1.5, token_ids=tokens, tid2eid=table, backend="triton", out=out)
    ref = moe_ops.route(x, gate, None, **{**kw, "backend": "torch", "out": None})
    moe_ops.route(x, gate, None, **kw)  # compile outside the sync check
    torch.cuda.synchronize()
    with no_host_syncs():
        moe_ops.route(x, gate, None, **kw)
    assert torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=0)  # fp32 sums of <= k terms in two orders: a few ulp
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_ops.route(x, gate, None, **kw)
    tokens.copy_(torch.randint(0, vocab, (t,), device="cuda"))
    x.copy_(torch.randn_like(x))
    graph.replay()
    replayed = (out[0].clone(), out[1].clone())
    eager = moe_ops.route(x, gate, None, **{**kw, "out": None})
    assert torch.equal(replayed[1], eager[1]) and torch.equal(replayed[0], eager[0])
    assert torch.equal(replayed[1], table[tokens])


@pytest.mark.cuda
def test_cuda_hash_route_flags_without_sync_and_in_graph():
    """Issue 12 on the GPU: an out-of-vocabulary token id is flagged by the router kernel with no host sync,
    eagerly and inside a graph replay; check_errors() names ("route", "token_ids") and clears the word."""
    from megamoe.ops import errors

    t, e, k, vocab = 64, 256, 6, 129280  # V4-Flash router shapes
    x = torch.randn(t, 4096, device="cuda").bfloat16()
    gate = torch.randn(e, 4096, device="cuda") * 4096 ** -0.5
    table = torch.rand(vocab, e, device="cuda").topk(k, dim=1).indices.int()
    tokens = torch.randint(0, vocab, (t,), device="cuda")
    out = (torch.empty(t, k, device="cuda"), torch.empty(t, k, dtype=torch.int32, device="cuda"))
    kw = dict(top_k=k, token_ids=tokens, tid2eid=table, backend="triton", out=out)
    word = errors.error_word("cuda")
    moe_ops.route(x, gate, None, **kw)
    errors.check_errors("cuda")  # valid ids: clean
    tokens[3], tokens[9] = vocab, -1
    torch.cuda.synchronize()
    with no_host_syncs():
        moe_ops.route(x, gate, None, **kw)
    eager = (out[0].clone(), out[1].clone())
    assert errors.peek_errors("cuda") == errors.flag("route", "token_ids")
    errors.clear_errors("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_ops.route(x, gate, None, **kw)
    errors.clear_errors("cuda")
    graph.replay()
    assert torch.equal(out[1], eager[1]) and torch.equal(out[0].nan_to_num(-1), eager[0].nan_to_num(-1))
    with pytest.raises(errors.DeviceIndexError, match="route: argument 'token_ids'"):
        errors.check_errors("cuda")
    assert int(word) == 0
