"""Reliability of the compressed cache: validation before mutation, allocator misuse, batch setters,
out-of-range device indices masked identically by the kernels and the references, post-pool and prefill
plumbing."""
import pytest
import torch

import megamoe.reference.kvcache as ref
import megamoe.reference.v4_numerics as v4
from megamoe.kvcache import BlockAllocator, CompressedCacheConfig, CompressedKVCache, DecodeBatch, ops
from guard_helpers import on_both_backends, set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)

SMALL = dict(head_dim=144, rope_dim=16, index_head_dim=64, index_n_heads=16, index_topk=8, window_size=8,
             entries_per_block=4, max_slots=3, max_context=64)


def _cache(kind="csa", device="cpu", batch=2, **kw):
    args = dict(SMALL)
    args.update(kw)
    cfg = CompressedCacheConfig(kind=kind, ratio=4 if kind == "csa" else 8, **args)
    cache = CompressedKVCache(cfg, device, batch=batch)
    freqs = v4.rope_frequencies(cfg.rope_dim, cfg.max_context, base=40000.0, original_seq_len=16, factor=4.0)
    cache.set_post_pool(1 + 0.1 * torch.randn(cfg.head_dim, device=device), freqs.to(device),
                        (1 + 0.1 * torch.randn(cfg.index_head_dim, device=device)) if cfg.has_indexer else None)
    return cache


def _snapshot(cache):
    ts = [cache.swa, cache.block_table] + cache.pool.tensors()     # swa: without the scratch row
    for st in (cache.state, cache.index_state):
        if st is not None:
            ts += [t for t in (st.tail_k, st.tail_z, st.tail_kb, st.tail_zb, st.tail_len) if t is not None]
    return [t.view(torch.uint8).clone() if t.dtype.is_floating_point else t.clone() for t in ts]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _inputs(cache, B, device="cpu"):
    c = cache.config
    C = 2 if c.overlap else 1
    d = dict(kv=torch.randn(B, C * c.head_dim, device=device), score=torch.randn(B, C * c.head_dim, device=device),
             swa_kv=torch.randn(B, c.head_dim, device=device).to(torch.bfloat16))
    if c.has_indexer:
        d.update(index_kv=torch.randn(B, C * c.index_head_dim, device=device),
                 index_score=torch.randn(B, C * c.index_head_dim, device=device),
                 q=torch.randn(B, c.index_n_heads, c.index_head_dim, device=device).to(torch.bfloat16),
                 weights=torch.randn(B, c.index_n_heads, device=device))
    return d


# ---------------------------------------------------------------------------------------------- host side
def test_block_allocator_rejects_double_and_foreign_release():
    a = BlockAllocator(4)
    pages = [a.allocate(), a.allocate()]
    a.release(pages[:1])
    with pytest.raises(ValueError, match="already free"):
        a.release(pages[:1])
    with pytest.raises(ValueError, match="not a page"):
        a.release([4])
    with pytest.raises(ValueError, match="not a page"):
        a.release([-1])
    with pytest.raises(ValueError, match="already free"):
        a.release([pages[1], pages[1]])                  # twice in one call
    assert a.num_free == 3                               # nothing of the failed calls was applied
    a.release([pages[1]])
    got = sorted(a.allocate() for _ in range(4))
    assert got == [0, 1, 2, 3]                           # free list not corrupted: each page exactly once
    with pytest.raises(RuntimeError):
        a.allocate()


def test_decode_batch_set_rejects_bad_lengths():
    b = DecodeBatch.allocate(3, "cpu")
    b.set([0, 1, 2], [5, 6, 7], [True, False, True])
    with pytest.raises(ValueError, match="positions"):
        b.set([0, 1, 2], [5, 6], [True, True, True])
    with pytest.raises(ValueError, match="slots"):
        b.set([0, 1], [5, 6], [True, True])
    with pytest.raises(ValueError, match="active"):
        b.set([0, 1, 2], [5, 6, 7], [True] * 4)
    assert b.positions.tolist() == [5, 6, 7]


def test_set_post_pool_validation():
    cfg = CompressedCacheConfig(kind="csa", **SMALL)
    cache = CompressedKVCache(cfg, "cpu", batch=1)
    freqs = v4.rope_frequencies(cfg.rope_dim, cfg.max_context, base=10000.0)
    w, iw = torch.ones(cfg.head_dim), torch.ones(cfg.index_head_dim)
    with pytest.raises(ValueError, match="decode_step: call set_post_pool"):
        cache.decode_step(DecodeBatch.allocate(1, "cpu"), **_inputs(cache, 1))
    with pytest.raises(ValueError, match="norm_weight"):
        cache.set_post_pool(torch.ones(cfg.head_dim - 1), freqs, iw)
    with pytest.raises(ValueError, match="rope_freqs"):
        cache.set_post_pool(w, freqs[:, :-1], iw)
    with pytest.raises(ValueError, match="rope_freqs"):
        cache.set_post_pool(w, freqs[:10], iw)                  # fewer positions than max_context
    with pytest.raises(ValueError, match="index_norm_weight"):
        cache.set_post_pool(w, freqs, None)
    cache.set_post_pool(w, freqs, iw)
    buf = cache.post_pool["norm"]
    cache.set_post_pool(2 * w, freqs, iw)                       # later calls update the same buffers
    assert cache.post_pool["norm"] is buf and bool((buf == 2).all())
    hca = CompressedKVCache(CompressedCacheConfig(kind="hca", **SMALL), "cpu")
    with pytest.raises(ValueError, match="index_norm_weight"):
        hca.set_post_pool(w, freqs, iw)


def test_config_numerics_validation():
    with pytest.raises(ValueError, match="entry_numerics"):
        CompressedCacheConfig(entry_numerics="fp8")
    with pytest.raises(ValueError, match="index_numerics"):
        CompressedCacheConfig(index_numerics="fp4")
    with pytest.raises(ValueError, match="multiple of 64"):
        CompressedCacheConfig(head_dim=64, rope_dim=16)
    CompressedCacheConfig(head_dim=64, rope_dim=16, entry_numerics="per_entry")   # any width per entry
    c = CompressedCacheConfig()
    assert (c.entry_scale_cols, c.index_scale_cols) == (7, 4)


# ---------------------------------------------------------------------------------------------- decode_step
@pytest.mark.parametrize("missing", ["index_kv", "q", "weights", "bad_q_shape", "bad_score_dtype", "bad_swa"])
def test_decode_step_validates_before_mutating(missing):
    cache = _cache()
    cache.join(0)
    cache.prepare_forward([0], [0], [8])
    batch = DecodeBatch.allocate(2, "cpu")
    batch.set([0, 1], [3, 0], [True, False])                     # row 0 would flush
    inp = _inputs(cache, 2)
    if missing in ("index_kv", "q", "weights"):
        inp[missing] = None
    elif missing == "bad_q_shape":
        inp["q"] = inp["q"][:, :-1].contiguous()
    elif missing == "bad_score_dtype":
        inp["score"] = inp["score"].double()
    else:
        inp["swa_kv"] = inp["swa_kv"].float()
    before = _snapshot(cache)
    with pytest.raises((ValueError, TypeError)):
        cache.decode_step(batch, **inp)
    assert _same(before, _snapshot(cache))


def test_hca_decode_step_rejects_indexer_inputs():
    cache = _cache("hca")
    inp = _inputs(cache, 2)
    inp["q"] = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="HCA"):
        cache.decode_step(DecodeBatch.allocate(2, "cpu"), **inp)
    assert _same(before, _snapshot(cache))


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_decode_step_slot_out_of_range_is_masked(interpret, monkeypatch):
    """Rows with slot >= max_slots or -1 (and a negative position) change nothing, on both backends."""
    set_interpret(monkeypatch, interpret)
    cache = _cache(batch=3)
    for s in range(3):
        cache.join(s)
    cache.prepare_forward([0, 1, 2], [0, 0, 0], [64, 64, 64])
    batch = DecodeBatch.allocate(3, "cpu")
    batch.set([3, -1, 0], [3, 7, -1], [True, True, True])       # every row out of range one way or another
    before = _snapshot(cache)
    topk = cache.decode_step(batch, **_inputs(cache, 3))
    assert _same(before, _snapshot(cache))
    assert bool((topk == -1).all())
    assert not bool(cache.workspace["flush"].any())


# ---------------------------------------------------------------------------------------------- kernels vs refs
def _both_backends(monkeypatch, fn):
    """Run fn() on the Triton path (interpreter) and on the reference path; return both results."""
    out = []
    for flag in ("1", "0"):
        set_interpret(monkeypatch, flag)
        out.append(fn())
    return out


def test_compressor_step_drops_out_of_range_slots(monkeypatch):
    cache = _cache(batch=4)
    st0 = cache.state.clone()
    slots = torch.tensor([-1, 3, 7, 1], dtype=torch.int32)
    positions = torch.tensor([3, 3, 0, -4], dtype=torch.int32)
    active = torch.ones(4, dtype=torch.bool)
    kv, score = torch.randn(4, 2 * 144), torch.randn(4, 2 * 144)

    def run():
        st = st0.clone()
        pooled = torch.full((4, 144), 7.0)
        flush = torch.ones(4, dtype=torch.bool)
        ops.compressor_step(st, kv, score, slots, positions, active, pooled, flush)
        return st, pooled, flush

    (a, pa, fa), (b, pb, fb) = _both_backends(monkeypatch, run)
    for st, pooled, flush in ((a, pa, fa), (b, pb, fb)):
        for name in ("tail_k", "tail_z", "tail_kb", "tail_zb", "tail_len"):
            assert torch.equal(getattr(st, name), getattr(st0, name)), name
        assert not bool(flush.any()) and bool((pooled == 7.0).all())


def test_flush_write_drops_out_of_range_slots_and_pages(monkeypatch):
    cache = _cache()
    cache.join(0)
    cache.join(1)
    cache.prepare_forward([0, 1], [0, 0], [16, 16])
    table = cache.block_table.clone()
    table[1, 0] = cache.config.num_blocks + 5                      # a corrupt page id past the pool
    pool0 = cache.pool.map(torch.clone)
    entry = torch.randn(4, 144).to(torch.bfloat16)
    key = torch.randn(4, 64).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 1, 0], dtype=torch.int32)
    positions = torch.tensor([3, 3, 3, -1], dtype=torch.int32)      # slot 3 / -1 / bad page / negative position
    flush = torch.ones(4, dtype=torch.bool)

    def run():
        pool = pool0.map(torch.clone)
        ops.flush_write(pool, table, entry, key, flush, slots, positions, ratio=4)
        return pool

    for pool in _both_backends(monkeypatch, run):
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                   for x, y in zip(pool.tensors(), pool0.tensors()))


def test_gather_and_scores_mask_out_of_range(monkeypatch):
    cache = _cache()
    cache.join(0)
    cache.prepare_forward([0], [0], [16])
    n = 4
    ops.flush_write(cache.pool, cache.block_table, torch.randn(n, 144).to(torch.bfloat16),
                    torch.randn(n, 64).to(torch.bfloat16), torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32) * 4 + 3, ratio=4)
    table = cache.block_table.clone()
    table[1, 0] = 10 ** 6                                          # slot 1 points past the pool
    slots = torch.tensor([0, 3, 1, -2], dtype=torch.int32)
    indices = torch.tensor([[0, 1, 2, 3]] * 4, dtype=torch.int32)

    def run():
        out = ops.gather_entries(cache.pool, table, slots, indices)
        scores = torch.empty(4, 8)
        q = torch.ones(4, 16, 64, dtype=torch.bfloat16)
        ops.indexer_scores(cache.pool, table, q, torch.ones(4, 16), slots,
                           torch.full((4,), n, dtype=torch.int32), scores)
        return out, scores

    (ga, sa), (gb, sb) = _both_backends(monkeypatch, run)
    assert torch.equal(ga.view(torch.int16), gb.view(torch.int16))
    assert bool((ga[1:] == 0).all()) and bool((ga[0] != 0).any())
    assert torch.isinf(sa[1:]).all() and torch.isfinite(sa[0, :n]).all()
    torch.testing.assert_close(sa, sb)


def test_swa_append_masks_out_of_range_slots():
    cache = _cache()
    before = cache.swa_rows.clone()
    kv = torch.randn(3, 144).to(torch.bfloat16)
    ops.swa_append(cache.swa_rows, 8, kv, torch.tensor([3, -1, 0], dtype=torch.int32),
                   torch.tensor([1, 2, -3], dtype=torch.int32), torch.ones(3, dtype=torch.bool))
    assert torch.equal(cache.swa, before[:-1].view_as(cache.swa))   # only the scratch row may change


# ---------------------------------------------------------------------------------------------- post-pool / prefill
def test_post_pool_rows_equal_reference():
    cache = _cache()
    pooled = torch.randn(5, 144) * 3
    pooled_key = torch.randn(5, 64)
    freqs = cache.post_pool["freqs"][torch.tensor([0, 4, 8, 60, 12])]
    got = cache._post_pool_rows(pooled, freqs, index=False)
    want = ref.post_pool(pooled, cache.post_pool["norm"], freqs, cache.config.norm_eps, rotate=False)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    got = cache._post_pool_rows(pooled_key, freqs, index=True)
    want = ref.post_pool(pooled_key, cache.post_pool["index_norm"], freqs, cache.config.norm_eps, rotate=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_prefill_validation_and_chunking():
    cache = _cache()
    cache.join(0)
    T = 22
    kv, score = torch.randn(T, 288), torch.randn(T, 288)
    swa = torch.randn(T, 144).to(torch.bfloat16)
    ikv, isc = torch.randn(T, 128), torch.randn(T, 128)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="prepare_forward"):
        cache.prefill(0, kv, score, swa, ikv, isc)
    cache.prepare_forward([0], [0], [T])
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="index_kv"):
        cache.prefill(0, kv, score, swa)
    with pytest.raises(ValueError, match="swa_kv"):
        cache.prefill(0, kv, score, swa[:-1], ikv, isc)
    assert _same(before, _snapshot(cache))
    # chunked pooling == one-shot pooling (bit for bit once a chunk holds every window; the reduction's
    # vectorisation may depend on the batch shape otherwise)
    one = ref.prefill_pool(kv, score, 4, 144, True)
    for chunk in (1, 2, 4, 5):
        got = ref.prefill_pool(kv, score, 4, 144, True, chunk_windows=chunk)
        torch.testing.assert_close(got[0], one[0], rtol=1e-6, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got[1:5], one[1:5])) and got[5] == one[5]
    assert torch.equal(ref.prefill_pool(kv, score, 4, 144, True, chunk_windows=5)[0], one[0])
    cache.prefill(0, kv, score, swa, ikv, isc)
    assert int(cache.state.tail_len[0]) == T % 4
    assert torch.equal(cache.state.tail_kb[0], kv[16:20, :144])
    assert torch.equal(cache.swa[0, torch.arange(T - 8, T) % 8], swa[T - 8:])


def test_select_topk_rejects_other_dtypes_clearly():
    """Issue 12 group 6: float64 scores used to fail with a broadcast message."""
    from megamoe.kvcache import ops as kv_ops

    with pytest.raises(TypeError, match=r"scores: expected a 2-D float32 tensor \(B, T\), got a torch.float64"):
        kv_ops.select_topk(torch.randn(2, 8, dtype=torch.float64), 3)
    with pytest.raises(TypeError, match="scores: expected a 2-D float32"):
        kv_ops.select_topk(torch.randn(8), 3)
    with pytest.raises(ValueError, match="k: expected a non-negative int"):
        kv_ops.select_topk(torch.randn(2, 8), -1)
    assert kv_ops.select_topk(torch.randn(2, 8), 3).shape == (2, 3)


# ---------------------------------------------------------------------------------------------- error-word flags
def _raises_naming(op: str, arg: str, word: int):
    """check_errors() on a word holding ``word`` names (op, arg) in its message."""
    from megamoe.ops import errors

    errors.error_word("cpu").fill_(word)
    with pytest.raises(errors.DeviceIndexError, match=f"{op}: argument '{arg}'"):
        errors.check_errors("cpu")


def test_flush_write_flags_out_of_range_not_markers(monkeypatch):
    """Issue 12: flush_write flags slots < -1 / >= S, positions < -1 / past the table, pages < -1 / >= P on
    flushing rows only (-1 markers and non-flushing rows are not errors), identically on both backends."""
    from megamoe.ops import errors

    cache = _cache()
    cache.join(0)
    cache.join(1)
    cache.prepare_forward([0, 1], [0, 0], [16, 16])
    pool0 = cache.pool.map(torch.clone)
    entry = torch.randn(2, 144).to(torch.bfloat16)
    key = torch.randn(2, 64).to(torch.bfloat16)
    f = lambda op_arg: errors.flag("flush_write", op_arg)  # noqa: E731
    cases = [  # (flush, slots, positions, table edit, expected flags)
        ([1, 1], [0, -1], [3, 3], None, 0),                          # slot -1: the "none" marker
        ([1, 1], [0, 1], [3, -1], None, 0),                          # position -1: the "none" marker
        ([1, 0], [0, 99], [3, -7], None, 0),                         # a row that does not flush: never checked
        ([1, 1], [0, 3], [3, 3], None, f("slots")),
        ([1, 1], [-2, 0], [3, 3], None, f("slots")),
        ([1, 1], [0, 1], [3, -5], None, f("positions")),
        ([1, 1], [0, 1], [3, 10 ** 6], None, f("positions")),       # entry past the block table
        ([1, 1], [0, 1], [3, 3], (1, 0, cache.config.num_blocks + 5), f("block_table")),
        ([1, 1], [0, 1], [3, 3], (1, 0, -4), f("block_table")),
        ([1, 1], [0, 1], [3, 3], (1, 0, -1), 0),                      # unallocated page: not an error
    ]
    for fl, sl, po, edit, expected in cases:
        table = cache.block_table.clone()
        if edit is not None:
            table[edit[0], edit[1]] = edit[2]
        flush = torch.tensor(fl, dtype=torch.bool)
        slots, positions = torch.tensor(sl, dtype=torch.int32), torch.tensor(po, dtype=torch.int32)

        def run():
            pool = pool0.map(torch.clone)
            ops.flush_write(pool, table, entry, key, flush, slots, positions, ratio=4)
            return pool

        (pa, wa), (pb, wb) = on_both_backends(monkeypatch, run)
        assert wa == wb == expected, (fl, sl, po, edit, wa, wb)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(pa.tensors(), pb.tensors()))
    _raises_naming("flush_write", "positions", f("positions"))


def test_compressor_step_flags_out_of_range_not_markers(monkeypatch):
    from megamoe.ops import errors

    cache = _cache(batch=2)
    st0 = cache.state.clone()
    kv, score = torch.randn(2, 2 * 144), torch.randn(2, 2 * 144)
    f = lambda op_arg: errors.flag("compressor_step", op_arg)  # noqa: E731
    cases = [  # (active, slots, positions, expected)
        ([1, 1], [0, -1], [3, 2], 0),
        ([1, 1], [0, 1], [2, -1], 0),
        ([1, 0], [0, 99], [3, -9], 0),                               # inactive rows are never checked
        ([1, 1], [0, 3], [3, 2], f("slots")),
        ([1, 1], [-5, 1], [3, 2], f("slots")),
        ([1, 1], [0, 1], [3, -2], f("positions")),
        ([1, 1], [7, 1], [3, -2], f("slots") | f("positions")),
    ]
    for ac, sl, po, expected in cases:
        active = torch.tensor(ac, dtype=torch.bool)
        slots, positions = torch.tensor(sl, dtype=torch.int32), torch.tensor(po, dtype=torch.int32)

        def run():
            st = st0.clone()
            pooled = torch.full((2, 144), 7.0)
            flush = torch.zeros(2, dtype=torch.bool)
            ops.compressor_step(st, kv, score, slots, positions, active, pooled, flush)
            return st, pooled, flush

        ((sa, qa, fa), wa), ((sb, qb, fb), wb) = on_both_backends(monkeypatch, run)
        assert wa == wb == expected, (ac, sl, po, wa, wb)
        assert torch.equal(fa, fb) and torch.equal(sa.tail_len, sb.tail_len)
        torch.testing.assert_close(qa, qb)
    _raises_naming("compressor_step", "slots", f("slots"))


def test_indexer_scores_flags_out_of_range_not_markers(monkeypatch):
    from megamoe.ops import errors

    cache = _cache()
    cache.join(0)
    cache.join(1)
    cache.prepare_forward([0, 1], [0, 0], [16, 8])                   # slot 1: pages past its 2nd block are -1
    n = 4
    ops.flush_write(cache.pool, cache.block_table, torch.randn(n, 144).to(torch.bfloat16),
                    torch.randn(n, 64).to(torch.bfloat16), torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32) * 4 + 3, ratio=4)
    cap = cache.block_table.shape[1] * cache.config.entries_per_block  # entries the block table can hold
    q = torch.randn(2, 16, 64).to(torch.bfloat16)
    w = torch.rand(2, 16)
    f = lambda op_arg: errors.flag("indexer_scores", op_arg)  # noqa: E731
    cases = [  # (slots, n_entries, scores width, table edit, expected)
        ([0, -1], [n, n], 8, None, 0),
        ([0, 1], [n, 12], 16, None, 0),                              # unallocated (-1) pages inside n: not errors
        ([0, 3], [n, n], 8, None, f("slots")),
        ([-2, 0], [n, n], 8, None, f("slots")),
        ([0, 0], [n, cap + 3], cap + 4, None, f("n_entries")),
        ([0, 0], [n, cap + 3], cap, None, 0),                       # clamped to the scores width first
        ([0, 1], [n, n], 8, (1, 0, 10 ** 6), f("block_table")),
        ([0, 1], [n, n], 8, (1, 0, -3), f("block_table")),
        ([0, 1], [n, 2], 8, (1, 1, 10 ** 6), 0),                     # page of no live entry: not read
    ]
    for sl, ne, width, edit, expected in cases:
        table = cache.block_table.clone()
        if edit is not None:
            table[edit[0], edit[1]] = edit[2]
        slots, n_entries = torch.tensor(sl, dtype=torch.int32), torch.tensor(ne, dtype=torch.int32)

        def run():
            scores = torch.empty(2, width)
            ops.indexer_scores(cache.pool, table, q, w, slots, n_entries, scores)
            return scores

        (sa, wa), (sb, wb) = on_both_backends(monkeypatch, run)
        assert wa == wb == expected, (sl, ne, width, edit, wa, wb)
        torch.testing.assert_close(sa, sb)
    _raises_naming("indexer_scores", "n_entries", f("n_entries"))


def test_swa_append_flags_out_of_range_not_markers(monkeypatch):
    """Issue 12: swa_append (and window_step's append) flags an active row's slot < -1 / >= S and position < -1;
    -1 markers and inactive rows are not errors; the invalid rows write only the scratch row; both backends give
    the same bits and the same ring."""
    from megamoe.ops import errors

    cache = _cache(batch=2)
    rows0 = cache.swa_rows.clone()
    kv = torch.randn(2, 144).to(torch.bfloat16)
    f = lambda op_arg: errors.flag("swa_append", op_arg)  # noqa: E731
    cases = [  # (active, slots, positions, expected)
        ([1, 1], [0, 2], [3, 17], 0),
        ([1, 1], [0, -1], [3, 2], 0),                                # slot -1: the "none" marker
        ([1, 1], [0, 1], [2, -1], 0),                                # position -1: the "none" marker
        ([1, 0], [0, 99], [3, -9], 0),                               # inactive rows are never checked
        ([1, 1], [0, 3], [3, 2], f("slots")),
        ([1, 1], [-5, 1], [3, 2], f("slots")),
        ([1, 1], [0, 1], [3, -2], f("positions")),
        ([1, 1], [7, 1], [3, -2], f("slots") | f("positions")),
    ]
    for ac, sl, po, expected in cases:
        active = torch.tensor(ac, dtype=torch.bool)
        slots, positions = torch.tensor(sl, dtype=torch.int32), torch.tensor(po, dtype=torch.int32)

        def run():
            rows = rows0.clone()
            ops.swa_append(rows, 8, kv, slots, positions, active)
            return rows

        (ra, wa), (rb, wb) = on_both_backends(monkeypatch, run)
        assert wa == wb == expected, (ac, sl, po, wa, wb)
        assert torch.equal(ra[:-1].view(torch.int16), rb[:-1].view(torch.int16))   # the scratch row: any writer
        ok = [a and 0 <= s < 3 and p >= 0 for a, s, p in zip(ac, sl, po)]
        written = {s * 8 + p % 8: b for b, (s, p, o) in enumerate(zip(sl, po, ok)) if o}
        for r in range(ra.shape[0] - 1):
            want = kv[written[r]] if r in written else rows0[r]
            assert torch.equal(ra[r].view(torch.int16), want.view(torch.int16)), (ac, sl, po, r)
    _raises_naming("swa_append", "positions", f("positions"))


# ---------------------------------------------------------------------------------------------- argument checks
def test_swa_append_rejects_non_contiguous_rows():
    """The window-step kernel addresses swa_rows as contiguous (S * window + 1, D) rows: padded or strided rows used
    to get the wrong elements written on the Triton path."""
    cache = _cache()
    kv = torch.randn(2, 144).to(torch.bfloat16)
    slots, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    active = torch.ones(2, dtype=torch.bool)
    padded = torch.zeros(cache.swa_rows.shape[0], 152, dtype=torch.bfloat16)[:, :144]
    strided = torch.zeros(cache.swa_rows.shape[0], 288, dtype=torch.bfloat16)[:, ::2]
    for rows in (padded, strided):
        with pytest.raises(ValueError, match="swa_rows: expected a contiguous tensor"):
            ops.swa_append(rows, 8, kv, slots, positions, active)
        with pytest.raises(ValueError, match="swa_rows: expected a contiguous tensor"):
            ops.window_step(rows, 8, kv, slots, positions, active)
        assert not bool(rows.any())


def _op_args(cache):
    """Valid arguments of each kvcache op on ``cache`` (CSA, 2 rows)."""
    c, B = cache.config, 2
    slots, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    active = torch.ones(B, dtype=torch.bool)
    return {
        "compressor_step": dict(state=cache.state, kv=torch.randn(B, 2 * c.head_dim),
                                score=torch.randn(B, 2 * c.head_dim), slots=slots, positions=positions,
                                active=active, pooled=torch.zeros(B, c.head_dim),
                                flush=torch.zeros(B, dtype=torch.bool)),
        "flush_write": dict(pool=cache.pool, block_table=cache.block_table,
                            entry=torch.randn(B, c.head_dim).to(torch.bfloat16),
                            index_key=torch.randn(B, c.index_head_dim).to(torch.bfloat16),
                            flush=torch.ones(B, dtype=torch.bool), slots=slots, positions=positions, ratio=4),
        "gather_entries": dict(pool=cache.pool, block_table=cache.block_table, slots=slots,
                               indices=torch.zeros(B, 3, dtype=torch.int32)),
        "indexer_scores": dict(pool=cache.pool, block_table=cache.block_table,
                               q=torch.randn(B, c.index_n_heads, c.index_head_dim).to(torch.bfloat16),
                               weights=torch.rand(B, c.index_n_heads), slots=slots,
                               n_entries=torch.tensor([1, 1], dtype=torch.int32), scores=torch.zeros(B, 8)),
        "indexer_topk": dict(pool=cache.pool, block_table=cache.block_table,
                             q=torch.randn(B, c.index_n_heads, c.index_head_dim).to(torch.bfloat16),
                             weights=torch.rand(B, c.index_n_heads), slots=slots,
                             n_entries=torch.tensor([1, 1], dtype=torch.int32), scores=torch.zeros(B, 8), k=4),
        "swa_append": dict(swa_rows=cache.swa_rows, window=c.window_size,
                           kv=torch.randn(B, c.head_dim).to(torch.bfloat16), slots=slots, positions=positions,
                           active=active),
        "window_step": dict(swa_rows=cache.swa_rows, window=c.window_size,
                            kv=torch.randn(B, c.head_dim).to(torch.bfloat16), slots=slots, positions=positions,
                            active=active, ratio=4, n_entries=torch.zeros(B, dtype=torch.int32),
                            entry_idx=torch.zeros(B, 4, dtype=torch.int32)),
    }


@pytest.mark.parametrize("op,arg,value", [
    ("compressor_step", "kv", [1.0, 2.0]), ("compressor_step", "kv", None), ("compressor_step", "state", None),
    ("compressor_step", "score", None), ("compressor_step", "pooled", [0.0]),
    ("flush_write", "entry", [1.0, 2.0]), ("flush_write", "entry", None), ("flush_write", "pool", None),
    ("flush_write", "block_table", [[0]]),
    ("gather_entries", "indices", [[0, 1]]), ("gather_entries", "indices", None), ("gather_entries", "pool", None),
    ("indexer_scores", "q", [[1.0]]), ("indexer_scores", "q", None), ("indexer_scores", "scores", [[0.0]]),
    ("indexer_scores", "pool", None),
    ("indexer_topk", "scores", [[0.0]]), ("indexer_topk", "q", None),
    ("swa_append", "kv", [1.0, 2.0]), ("swa_append", "kv", None), ("swa_append", "swa_rows", [[0.0]]),
    ("swa_append", "active", [True, True]),
    ("window_step", "entry_idx", [[0]]), ("window_step", "swa_rows", None),
])
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_kvcache_ops_reject_non_tensors(op, arg, value, interpret, monkeypatch):
    """A list / None where a tensor (or the pool / state) belongs: TypeError naming the argument (used to be an
    AttributeError from inside the op)."""
    set_interpret(monkeypatch, interpret)
    cache = _cache()
    kw = _op_args(cache)[op]
    kw[arg] = value
    before = _snapshot(cache)
    with pytest.raises(TypeError, match=f"^{arg}: expected"):
        getattr(ops, op)(**kw)
    assert _same(before, _snapshot(cache))


@pytest.mark.parametrize("ratio", [0, -4, True, 4.0, None, "4"])
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_flush_write_rejects_bad_ratio(ratio, interpret, monkeypatch):
    set_interpret(monkeypatch, interpret)
    cache = _cache()
    cache.join(0)
    cache.join(1)
    cache.prepare_forward([0, 1], [0, 0], [8, 8])
    kw = _op_args(cache)["flush_write"]
    kw["ratio"] = ratio
    before = _snapshot(cache)
    with pytest.raises((TypeError, ValueError), match="^ratio: expected an int >= 1"):
        ops.flush_write(**kw)
    assert _same(before, _snapshot(cache))


@pytest.mark.parametrize("op,arg,bad,match", [
    ("gather_entries", "indices", lambda t: t[0].contiguous(), r"indices: expected a 2-D \(B, K\) int32 tensor"),
    ("gather_entries", "indices", lambda t: t[None].contiguous(), r"indices: expected a 2-D \(B, K\) int32 tensor"),
    ("indexer_scores", "q", lambda t: t[:, 0].contiguous(), r"q: expected a 3-D \(B, H, Di\) bf16 tensor"),
    ("indexer_scores", "q", lambda t: t[None].contiguous(), r"q: expected a 3-D \(B, H, Di\) bf16 tensor"),
])
def test_kvcache_ops_name_the_rank(op, arg, bad, match):
    cache = _cache()
    kw = _op_args(cache)[op]
    kw[arg] = bad(kw[arg])
    with pytest.raises(ValueError, match=match):
        getattr(ops, op)(**kw)


@pytest.mark.parametrize("slot", [True, False, -1, 3, 1.0, "0", None])
def test_cache_slot_must_be_an_int_in_range(slot):
    """bool is not a slot (True used to be slot 1)."""
    cache = _cache()
    for call in (cache.join, cache.leave):
        with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 3\)"):
            call(slot)


def test_decode_step_rejects_non_tensors():
    cache = _cache()
    inp = _inputs(cache, 2)
    before = _snapshot(cache)
    with pytest.raises(TypeError, match="^batch: expected a DecodeBatch"):
        cache.decode_step(None, **inp)
    inp["kv"] = inp["kv"].tolist()
    with pytest.raises(TypeError, match="^kv: expected a torch.Tensor"):
        cache.decode_step(DecodeBatch.allocate(2, "cpu"), **inp)
    assert _same(before, _snapshot(cache))


@pytest.mark.cuda
def test_cuda_prepare_forward_copies_the_block_table_without_a_host_sync():
    """``prepare_forward`` on a CUDA cache: the block table reaches the device from a pinned snapshot without a host
    sync (sync debug mode "error"), and later host changes (the next step's pages) do not reach an earlier copy."""
    from sync_helpers import no_host_syncs  # tests/sync_helpers.py (tests/ is on sys.path)

    cache = _cache(device="cuda")
    cache.join(0)
    cache.join(1)
    torch.cuda.synchronize()
    with no_host_syncs():
        cache.prepare_forward([0, 1], [0, 0], [16, 16])
    first = cache.block_table.clone()  # stream-ordered after the copy
    expect_first = cache._host_table.clone()
    with no_host_syncs():
        cache.prepare_forward([0, 1], [16, 16], [40, 32])
    torch.cuda.synchronize()
    assert torch.equal(first.cpu(), expect_first)
    assert torch.equal(cache.block_table.cpu(), cache._host_table)
    assert not torch.equal(expect_first, cache._host_table)  # the second step allocated pages
