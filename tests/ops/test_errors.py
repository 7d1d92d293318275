"""Device-side index guard (megamoe/ops/errors.py): out-of-range device indices are dropped by the same rule on
the Triton path (interpreter on CPU, the GPU kernels on CUDA) and the torch path, and flagged in the device's
error word, which check_errors() reports by op and argument and clears."""
import pytest
import torch

from megamoe.ops import errors
from megamoe.ops import gemm as gemm_ops
from megamoe.ops import moe as moe_ops
from gemm_helpers import offsets_of, random_weight  # tests/gemm_helpers.py (tests/ is on sys.path)
from guard_helpers import on_both_backends, require_interpreter
from sync_helpers import no_host_syncs


def test_error_word_cached_and_check_names_op_and_argument():
    word = errors.error_word("cpu")
    assert errors.error_word(torch.device("cpu")) is word and word.dtype == torch.int32 and word.shape == (1,)
    errors.check_errors("cpu")  # clean: no raise
    word |= errors.flag("combine", "inv_perm") | errors.flag("dispatch", "topk_ids")
    with pytest.raises(errors.DeviceIndexError, match=r"combine: argument 'inv_perm'.*dispatch: argument 'topk_ids'") \
            as info:
        errors.check_errors("cpu")
    assert info.value.flags == [("combine", "inv_perm"), ("dispatch", "topk_ids")]
    assert int(word) == 0  # cleared by the check
    errors.check_errors()
    assert len(set(errors.FLAGS.values())) == len(errors.FLAGS)


def _assert_within_one_bf16_ulp(got, want):
    """bf16 outputs of two fp32 summation orders: equal zeros, elsewhere at most one bf16 ulp of the larger."""
    g, w = got.float(), want.float()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2.0 ** -126))) - 7)
    assert bool(((g - w).abs() <= ulp).all()), float(((g - w).abs() / ulp).max())


@pytest.mark.parametrize("bad", [100, -1, 2**31 - 1])
def test_grouped_mm_row_index_out_of_range_dropped_and_flagged(monkeypatch, bad):
    e, n, k, s = 3, 32, 64, 5
    w = random_weight((e, n, k), "cpu")
    x = torch.randn(s, k).to(torch.bfloat16)
    counts = [2, 0, 3]
    offsets = offsets_of(counts, "cpu")
    row_index = torch.tensor([0, bad, 4, 1, 2, bad], dtype=torch.int32)  # last row is padding: not flagged
    good = row_index.clone()
    good[1] = 0

    def run():
        return gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=row_index)

    (a, wa), (b, wb) = on_both_backends(monkeypatch, run)
    # the interpreter's tl.dot and the torch path sum the 64 products in different fp32 orders: a bf16 output may
    # round one ulp apart (2 of 40 seeds did); a wrong row, a non-dropped bad row or a lost scale is far off
    _assert_within_one_bf16_ulp(a, b)
    assert wa == wb == errors.flag("nvfp4_grouped_mm", "row_index")
    assert bool((a[1] == 0).all()) and bool((a[5] == 0).all())  # dropped row: zero activations
    assert bool((b[1] == 0).all()) and bool((b[5] == 0).all())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref = gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=good)
    assert torch.equal(b[[0, 2, 3, 4]], ref[[0, 2, 3, 4]])  # the same torch path: bit for bit
    _assert_within_one_bf16_ulp(a[[0, 2, 3, 4]], ref[[0, 2, 3, 4]])
    errors.clear_errors("cpu")


def test_grouped_mm_padding_row_index_not_flagged(monkeypatch):
    w = random_weight((2, 32, 64), "cpu")
    x = torch.randn(3, 64).to(torch.bfloat16)
    row_index = torch.tensor([0, 2, -7, 99], dtype=torch.int32)  # rows 2, 3 are padding (offsets[-1] = 2)
    for out, word in on_both_backends(monkeypatch, lambda: gemm_ops.nvfp4_grouped_mm(
            x, w, offsets_of([1, 1], "cpu"), row_index=row_index)):
        assert word == 0 and bool((out[2:] == 0).all())


@pytest.mark.parametrize("bad", [100, -1])
def test_gemv_launcher_row_index_guard(bad):
    """The CUDA-core decode kernel under the interpreter: same drop rule and flag."""
    from megamoe.kernels.gemm.nvfp4_gemv import launch_nvfp4_gemv

    require_interpreter()

    w = random_weight((2, 32, 64), "cpu")
    x = torch.randn(4, 64).to(torch.bfloat16)
    offsets = offsets_of([2, 1], "cpu")
    row_index = torch.tensor([3, bad, 0], dtype=torch.int32)
    word = torch.zeros(1, dtype=torch.int32)
    out = torch.full((3, 32), 9.0, dtype=torch.bfloat16)
    launch_nvfp4_gemv(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, row_index=row_index,
                      interpreter=True, error_word=word)
    assert int(word) == errors.flag("nvfp4_grouped_mm", "row_index")
    ref = torch.ops.aten.clone(out)
    from megamoe.reference.gemm import nvfp4_grouped_mm as ref_mm
    ref = ref_mm(x, w, offsets, row_index=row_index)
    assert bool((out[1] == 0).all())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bad", [6, -1, -(2**31)])
def test_combine_inv_perm_out_of_range_dropped_and_flagged(monkeypatch, bad):
    t, k, h, r = 3, 2, 80, 6
    y = torch.randn(r, h).to(torch.bfloat16)
    w = torch.rand(t, k)
    w[1, 0] = float("nan")  # a dropped pair's NaN weight does not leak
    inv = torch.tensor([0, 1, bad, 3, 4, 5], dtype=torch.int32)
    shared = torch.randn(t, h).to(torch.bfloat16)
    (a, wa), (b, wb) = on_both_backends(monkeypatch, lambda: moe_ops.combine(y, inv, w, shared))
    assert torch.equal(a, b) and torch.isfinite(a[1]).all()
    assert wa == wb == errors.flag("combine", "inv_perm")
    expect = (shared[1].float() + w[1, 1] * y[3].float()).to(torch.bfloat16)
    assert torch.equal(a[1], expect)
    errors.clear_errors("cpu")


@pytest.mark.parametrize("bad", [4, -1, 1000])
def test_dispatch_invalid_ids_dropped_to_padding(monkeypatch, bad):
    e = 4
    ids = torch.tensor([[1, bad], [0, 1], [bad, 3]], dtype=torch.int32)
    results = []
    for backend in ("triton", "torch"):
        errors.clear_errors("cpu")
        d = moe_ops.dispatch(ids, e, backend=backend)
        results.append((d, errors.peek_errors("cpu")))
    (a, wa), (b, wb) = results
    for key in ("expert_offsets", "sorted_expert", "row_index", "inv_perm"):
        assert torch.equal(a[key], b[key]), key
    assert wa == wb == errors.flag("dispatch", "topk_ids")
    assert a["expert_offsets"].tolist() == [1, 3, 3, 4]
    assert a["sorted_expert"][4:].tolist() == [e, e]  # the dropped pairs, after every real expert
    assert sorted(a["inv_perm"][[1, 4]].tolist()) == [4, 5]
    errors.clear_errors("cpu")


def test_dispatch_valid_ids_do_not_flag():
    ids = torch.randint(0, 8, (5, 3), dtype=torch.int32)
    for backend in ("triton", "torch"):
        moe_ops.dispatch(ids, 8, backend=backend)
        assert errors.peek_errors("cpu") == 0


def test_gather_entries_flags(monkeypatch):
    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location(
        "_kv_rel", pathlib.Path(__file__).parents[1] / "kvcache" / "test_kvcache_reliability.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _cache = mod._cache
    from megamoe.kvcache import ops as kv_ops

    cache = _cache()
    cache.join(0)
    cache.prepare_forward([0], [0], [16])
    table = cache.block_table.clone()
    cases = [  # (slots, indices, table edit, expected flags)
        ([0, -1], [[0, -1], [-1, -1]], None, 0),  # -1 markers are not errors
        ([0, 5], [[0, 1], [0, 1]], None, errors.flag("gather_entries", "slots")),
        ([0, -2], [[0, 1], [0, 1]], None, errors.flag("gather_entries", "slots")),
        ([0, 0], [[0, -3], [10 ** 6, 1]], None, errors.flag("gather_entries", "indices")),
        ([1, 0], [[0, 1], [0, 1]], (1, 0, 10 ** 6), errors.flag("gather_entries", "block_table")),
    ]
    for slots, indices, edit, expected in cases:
        tab = table.clone()
        if edit is not None:
            tab[edit[0], edit[1]] = edit[2]
        s = torch.tensor(slots, dtype=torch.int32)
        i = torch.tensor(indices, dtype=torch.int32)
        (a, wa), (b, wb) = on_both_backends(monkeypatch, lambda: kv_ops.gather_entries(cache.pool, tab, s, i))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert wa == wb == expected, (slots, indices, edit, wa, wb)


def test_layer_eager_forward_raises_on_flag():
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import MoEConfig

    cfg = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2, shared_intermediate_size=32)
    layer = Nvfp4MoE.random(cfg, seed=0, max_num_tokens=4)
    x = torch.randn(2, 64).to(torch.bfloat16)
    layer.forward(x)  # clean
    errors.error_word("cpu").fill_(errors.flag("combine", "inv_perm"))  # as if a kernel had dropped a pair
    with pytest.raises(errors.DeviceIndexError, match="inv_perm"):
        layer.forward(x)
    prev = errors.set_eager_checks(False)
    try:
        errors.error_word("cpu").fill_(errors.flag("combine", "inv_perm"))
        layer.forward(x)  # checks off: no raise
    finally:
        errors.set_eager_checks(prev)
        errors.clear_errors("cpu")


# ---------------------------------------------------------------------------------------------- RoPE positions
def _few_bit(*shape, dtype=torch.bfloat16):
    """k / 8, k in -15..15: every float32 sum (norms, Hadamard) is exact, so the backends agree bit for bit."""
    return (torch.randint(-15, 16, shape).float() / 8).to(dtype)


def _rope_ops(T=4, n=16, rd=32, H=2, D=96, Di=64):
    """The four RoPE ops on fresh few-bit inputs at tiny shapes: run(positions) -> their outputs (bf16 / f32)."""
    from megamoe.ops import v4_elementwise as ew
    from megamoe.reference import v4_numerics as nx

    freqs = nx.rope_frequencies(rd, n, base=10000.0)
    q, kv, w = _few_bit(T, H * D), _few_bit(T, D), 1 + _few_bit(D, dtype=torch.float32) / 16
    iq, iw, o = _few_bit(T, H * Di), _few_bit(T, H), _few_bit(T, H, D)
    pooled = _few_bit(T, Di, dtype=torch.float32)

    def run(op, pos):
        if op == "q_kv_path":
            return ew.q_kv_path(q, kv, w, freqs, pos, num_heads=H, eps=0.0)
        if op == "index_q_path":
            return ew.index_q_path(iq, iw, freqs, pos, n_heads=H, weight_scale=0.5)
        if op == "output_path":
            return (ew.output_path(o, freqs, pos, groups=2),)
        out = torch.empty(T, Di, dtype=torch.bfloat16)
        return (ew.post_pool(pooled, w[:Di], freqs, pos, out, shift=-3, eps=0.0, rotate=True),)

    return run


@pytest.mark.parametrize("op", ["q_kv_path", "index_q_path", "output_path", "post_pool"])
def test_rope_positions_out_of_range_rotate_by_zero_and_flagged(monkeypatch, op):
    """Issue 12: a position outside the RoPE table gives its RoPE dims the rotation 0 (post_pool: clamped row) and
    flags (op, "positions"); the interpreter kernel and the torch path give the same bits and the same outputs;
    valid positions (post_pool: a window start below 0 too) flag nothing."""
    run = _rope_ops()
    bit = errors.flag(op, "positions")
    if op == "post_pool":  # row clamp(pos - 3, 0, 15): pos 0..2 and -1 are legitimate (clamped to row 0)
        cases = [([0, 18, -1, 2], 0), ([0, 19, 2, 3], bit), ([5, 2, 10 ** 6, 3], bit)]
    else:
        cases = [([0, 15, 3, 7], 0), ([0, 16, 3, 7], bit), ([0, 1, -1, 2], bit), ([2, -5, 2 ** 40, 0], bit)]
    for values, expected in cases:
        for dtype in (torch.int32, torch.int64) if max(values) < 2 ** 31 else (torch.int64,):
            pos = torch.tensor(values, dtype=dtype)
            (a, wa), (b, wb) = on_both_backends(monkeypatch, lambda: run(op, pos))
            assert wa == wb == expected, (op, values, wa, wb)
            for x, y in zip(a, b):
                bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
                assert torch.equal(x.view(bits), y.view(bits)), (op, values)
            if op != "post_pool" and op != "index_q_path":   # the bad tokens' RoPE dims (the last 32) are zeros
                bad = [t for t, p in enumerate(values) if not 0 <= p < 16]
                out = a[0] if op == "q_kv_path" else a[0].view(2, 4, -1).transpose(0, 1)
                assert bool((out[bad][..., -32:] == 0).all())
                assert op != "q_kv_path" or bool((a[1][bad][..., -32:] == 0).all())
    errors.error_word("cpu").fill_(bit)
    with pytest.raises(errors.DeviceIndexError, match=f"{op}: argument 'positions'"):
        errors.check_errors("cpu")


@pytest.mark.cuda
def test_cuda_guard_graph_replay_equals_eager_and_no_sync():
    """On the GPU: invalid row_index / inv_perm / ids are dropped by every kernel without a host sync, the word is
    set inside a graph replay too, and check_errors() reports it between replays."""
    dev = torch.device("cuda")
    word = errors.error_word(dev)
    e, n, k = 8, 256, 512
    w = random_weight((e, n, k), dev)
    x = torch.randn(16, k, device=dev).to(torch.bfloat16)
    offsets = offsets_of([2, 0, 3, 1, 0, 4, 2, 2], dev)
    row_index = torch.randint(0, 16, (16,), dtype=torch.int32, device=dev)
    row_index[3], row_index[7] = 100, -1
    ids = torch.randint(0, e, (4, 2), dtype=torch.int32, device=dev)
    ids[1, 1] = e
    errors.clear_errors(dev)
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=row_index)
        d = moe_ops.dispatch(ids, e, backend="triton")
    assert errors.peek_errors(dev) == errors.flag("nvfp4_grouped_mm", "row_index") | errors.flag("dispatch",
                                                                                                   "topk_ids")
    assert bool((eager[3] == 0).all()) and bool((eager[7] == 0).all())
    errors.clear_errors(dev)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, out=out)
    torch.cuda.current_stream().wait_stream(s)
    errors.clear_errors(dev)
    with torch.cuda.graph(graph):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, out=out)
    graph.replay()
    assert torch.equal(out, eager)
    with pytest.raises(errors.DeviceIndexError, match="row_index"):
        errors.check_errors(dev)
    assert int(word) == 0
    ref = gemm_ops.nvfp4_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=row_index.cpu())
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)
    errors.clear_errors("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 64, 200])
def test_cuda_grouped_mm_all_routes_guard(tokens):
    """Every decode route (mma / wgmma / gemv / tensor-core, chosen by shape) drops and flags a bad row_index."""
    dev = torch.device("cuda")
    e, n, k = 16, 512, 1024
    w = random_weight((e, n, k), dev)
    x = torch.randn(tokens, k, device=dev).to(torch.bfloat16)
    pairs = tokens * 4
    counts = torch.bincount(torch.randint(0, e, (pairs,)), minlength=e).tolist()
    offsets = offsets_of(counts, dev)
    row_index = torch.randint(0, tokens, (pairs,), dtype=torch.int32, device=dev)
    row_index[0] = tokens + 5
    errors.clear_errors(dev)
    out = gemm_ops.nvfp4_grouped_mm(x, w, offsets, row_index=row_index)
    assert errors.peek_errors(dev) == errors.flag("nvfp4_grouped_mm", "row_index")
    ref = gemm_ops.nvfp4_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=row_index.cpu())
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)
    errors.clear_errors(dev)
    errors.clear_errors("cpu")


@pytest.mark.cuda
def test_cuda_kvcache_kernels_flag_without_sync_and_in_graph():
    """Issue 12 on the GPU, V4 cache shapes: the compressor-step, flush-write and indexer kernels flag
    out-of-range slots / positions / pages / n_entries with no host sync, eagerly and in a graph replay (== eager),
    with the same bits as the torch path on CPU; -1 markers set nothing."""
    from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache
    from megamoe.kvcache import ops as kv_ops

    dev = torch.device("cuda")
    cfg = CompressedCacheConfig(kind="csa", max_slots=4, max_context=4096)
    cache = CompressedKVCache(cfg, dev, batch=4)
    for s in range(3):
        cache.join(s)
    cache.prepare_forward([0, 1, 2], [0, 0, 0], [1024, 1024, 512])
    B, D, Di, H = 4, cfg.head_dim, cfg.index_head_dim, cfg.index_n_heads
    table = cache.block_table.clone()
    table[2, 1] = cfg.num_blocks + 3                               # a corrupt page id
    slots = torch.tensor([0, -1, 9, 2], dtype=torch.int32, device=dev)      # -1: marker; 9 >= S: error
    positions = torch.tensor([3, 7, 3, 64 * 4 * 1 + 3], dtype=torch.int32, device=dev)   # row 3: page (2, 1)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    kv, score = torch.randn(B, 2 * D, device=dev), torch.randn(B, 2 * D, device=dev)
    entry = torch.randn(B, D, device=dev).bfloat16()
    key = torch.randn(B, Di, device=dev).bfloat16()
    q = torch.randn(B, H, Di, device=dev).bfloat16()
    w = torch.rand(B, H, device=dev)
    n_entries = torch.tensor([200, 5, 5, 100], dtype=torch.int32, device=dev)
    pooled = torch.zeros(B, D, device=dev)
    flush = torch.ones(B, dtype=torch.bool, device=dev)
    scores = torch.empty(B, cfg.max_context // cfg.ratio, device=dev)
    f = errors.flag
    expected = f("compressor_step", "slots") | f("flush_write", "slots") | f("flush_write", "block_table") \
        | f("indexer_scores", "slots") | f("indexer_scores", "block_table")

    def step(st, pool):
        kv_ops.compressor_step(st, kv, score, slots, positions, active, pooled, torch.zeros_like(flush))
        kv_ops.flush_write(pool, table, entry, key, flush, slots, positions, ratio=cfg.ratio)
        kv_ops.indexer_scores(pool, table, q, w, slots, n_entries, scores)

    word = errors.error_word(dev)
    st, pool = cache.state.clone(), cache.pool.map(torch.clone)
    errors.clear_errors(dev)
    torch.cuda.synchronize()
    with no_host_syncs():
        step(st, pool)
    assert errors.peek_errors(dev) == expected
    eager = (st.tail_len.clone(), [t.clone() for t in pool.tensors()], scores.clone())
    # torch path on CPU: the same bits
    ccache = CompressedKVCache(cfg, "cpu", batch=4)
    for s_ in range(3):
        ccache.join(s_)
    ccache.prepare_forward([0, 1, 2], [0, 0, 0], [1024, 1024, 512])
    errors.clear_errors("cpu")
    kv_ops.compressor_step(ccache.state, kv.cpu(), score.cpu(), slots.cpu(), positions.cpu(), active.cpu(),
                           pooled.cpu(), torch.zeros(B, dtype=torch.bool))
    kv_ops.flush_write(ccache.pool, table.cpu(), entry.cpu(), key.cpu(), flush.cpu(), slots.cpu(), positions.cpu(),
                       ratio=cfg.ratio)
    kv_ops.indexer_scores(ccache.pool, table.cpu(), q.cpu(), w.cpu(), slots.cpu(), n_entries.cpu(), scores.cpu())
    cpu_expected = expected
    assert errors.peek_errors("cpu") == cpu_expected
    errors.clear_errors("cpu")
    # graph replay == eager, the word set inside the replay
    st, pool = cache.state.clone(), cache.pool.map(torch.clone)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(cache.state.clone(), cache.pool.map(torch.clone))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(st, pool)
    errors.clear_errors(dev)
    graph.replay()
    assert torch.equal(st.tail_len, eager[0]) and torch.equal(scores, eager[2])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pool.tensors(), eager[1]))
    with pytest.raises(errors.DeviceIndexError, match="flush_write: argument 'block_table'"):
        errors.check_errors(dev)
    assert int(word) == 0
    # -1 markers only: nothing flagged
    slots.copy_(torch.tensor([0, -1, -1, 1], dtype=torch.int32))
    table.copy_(cache.block_table)
    graph.replay()
    assert errors.peek_errors(dev) == 0


@pytest.mark.cuda
def test_cuda_rope_and_swa_append_flag_without_sync_and_in_graph():
    """Issue 12 on the GPU, V4-Flash shapes: the four RoPE kernels (q/kv, indexer query, output, post-pool) and the
    window-step kernel's SWA append flag out-of-range positions / slots with no host sync, eagerly and in a graph
    replay (== eager), with the same bits as the torch path on CPU; the bad tokens' RoPE dims are zeros; valid
    positions and -1 markers set nothing."""
    from megamoe.kvcache import ops as kv_ops
    from megamoe.ops import v4_elementwise as ew
    from megamoe.reference import v4_numerics as nx

    dev = torch.device("cuda")
    T, H, D, rd, NI, Di, G, n, W, S = 4, 64, 512, 64, 64, 128, 8, 4096, 128, 4
    freqs = nx.rope_frequencies(rd, n, base=10000.0).to(dev)
    q, kv = torch.randn(T, H * D, device=dev).bfloat16(), torch.randn(T, D, device=dev).bfloat16()
    w = 1 + 0.1 * torch.randn(D, device=dev)
    iq, iw = torch.randn(T, NI * Di, device=dev).bfloat16(), torch.randn(T, NI, device=dev).bfloat16()
    o = torch.randn(T, H, D, device=dev).bfloat16()
    pooled = torch.randn(T, D, device=dev)
    pp_out = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    swa = torch.zeros(S * W + 1, D, dtype=torch.bfloat16, device=dev)
    wrows = torch.empty(T, W, dtype=torch.int32, device=dev)
    pos = torch.tensor([5, n, -1, 7], dtype=torch.int32, device=dev)         # n, -1: outside the table
    pp_pos = torch.tensor([0, n + 3, 9, 2], dtype=torch.int32, device=dev)   # n + 3 - 3 >= n: past the table
    slots = torch.tensor([0, -1, S, 2], dtype=torch.int32, device=dev)       # -1: marker; S: error
    swa_pos = torch.tensor([3, 4, 5, -3], dtype=torch.int32, device=dev)     # -3: error
    active = torch.ones(T, dtype=torch.bool, device=dev)
    f = errors.flag
    expected = f("q_kv_path", "positions") | f("index_q_path", "positions") | f("output_path", "positions") \
        | f("post_pool", "positions") | f("swa_append", "slots") | f("swa_append", "positions")

    def step(out):
        qq, kk = ew.q_kv_path(q, kv, w, freqs, pos, num_heads=H, eps=1e-6)
        xq, xw = ew.index_q_path(iq, iw, freqs, pos, n_heads=NI, weight_scale=0.5)
        oo = ew.output_path(o, freqs, pos, groups=G)
        ew.post_pool(pooled, w, freqs, pp_pos, pp_out, shift=-3, eps=1e-6, rotate=False)
        kv_ops.window_step(swa, W, kv, slots, swa_pos, active, wrows)
        for dst, src in zip(out, (qq, kk, xq, xw, oo)):
            dst.copy_(src)

    shapes = [((T, H, D), torch.bfloat16), ((T, D), torch.bfloat16), ((T, NI, Di), torch.bfloat16),
              ((T, NI), torch.float32), ((G, T, H * D // G), torch.bfloat16)]
    eager = [torch.empty(s, dtype=d, device=dev) for s, d in shapes]
    word = errors.error_word(dev)
    errors.clear_errors(dev)
    torch.cuda.synchronize()
    with no_host_syncs():
        step(eager)
    assert errors.peek_errors(dev) == expected
    eager += [pp_out.clone(), swa.clone()]
    for t in (1, 2):                                     # the bad tokens: RoPE dims zeros
        assert bool((eager[0][t, :, -rd:] == 0).all()) and bool((eager[1][t, -rd:] == 0).all())
        assert bool((eager[4][:, t].reshape(-1, D)[:, -rd:] == 0).all())
    # torch path on CPU: the same bits, close outputs (GPU rsqrt / summation order)
    errors.clear_errors("cpu")
    cq, ckv = ew.q_kv_path(q.cpu(), kv.cpu(), w.cpu(), freqs.cpu(), pos.cpu(), num_heads=H, eps=1e-6)
    ew.index_q_path(iq.cpu(), iw.cpu(), freqs.cpu(), pos.cpu(), n_heads=NI, weight_scale=0.5)
    co = ew.output_path(o.cpu(), freqs.cpu(), pos.cpu(), groups=G)
    cpp = ew.post_pool(pooled.cpu(), w.cpu(), freqs.cpu(), pp_pos.cpu(), torch.empty(T, D, dtype=torch.bfloat16),
                       shift=-3, eps=1e-6, rotate=False)
    cswa = torch.zeros(S * W + 1, D, dtype=torch.bfloat16)
    kv_ops.window_step(cswa, W, kv.cpu(), slots.cpu(), swa_pos.cpu(), active.cpu(),
                       torch.empty(T, W, dtype=torch.int32))
    assert errors.peek_errors("cpu") == expected
    errors.clear_errors("cpu")
    for got, want in ((eager[0], cq), (eager[1], ckv), (eager[4], co), (eager[5], cpp)):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(eager[6][:-1].cpu(), cswa[:-1])
    # graph replay == eager, the word set inside the replay
    out = [torch.empty_like(t) for t in eager[:5]]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(out)
    errors.clear_errors(dev)
    swa.zero_()
    graph.replay()
    # the ring's last row is the scratch row: several bad tokens write it at once (which one lands is a race, as
    # documented for swa_append), so it is excluded like in the CPU comparison above (H100, gpu_check_v11)
    for a, b in zip(out + [pp_out, swa[:-1]], eager[:6] + [eager[6][:-1]]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(errors.DeviceIndexError, match="q_kv_path: argument 'positions'"):
        errors.check_errors(dev)
    assert int(word) == 0
    # valid positions, -1 markers only: nothing flagged
    pos.copy_(torch.tensor([5, n - 1, 0, 7], dtype=torch.int32))
    pp_pos.copy_(torch.tensor([0, n + 2, 9, 2], dtype=torch.int32))   # n + 2 - 3: row n - 1, the last
    slots.copy_(torch.tensor([0, -1, -1, 2], dtype=torch.int32))
    swa_pos.copy_(torch.tensor([3, -1, 5, 6], dtype=torch.int32))
    graph.replay()
    assert errors.peek_errors(dev) == 0
