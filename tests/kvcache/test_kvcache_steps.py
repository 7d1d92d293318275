"""Each compressed-cache step: Triton path (GPU, or the interpreter on CPU) vs the PyTorch reference."""
import pytest
import torch

import megamoe.reference.kvcache as ref
import megamoe.reference.v4_numerics as v4
from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache, ops
from megamoe.kvcache.state import CompressorState

SMALL = dict(head_dim=144, rope_dim=16, index_head_dim=64, index_n_heads=16, index_topk=8, window_size=8,
             entries_per_block=4, max_slots=5, max_context=256)
NUMERICS = [("official", "official"), ("per_entry", "nvfp4")]


def _cfg(kind, ratio=None, **kw):
    args = dict(SMALL)
    args.update(kw)
    return CompressedCacheConfig(kind=kind, ratio=ratio, **args)


def _batch(slots, positions, active, device):
    return (torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(positions, dtype=torch.int32, device=device),
            torch.tensor(active, dtype=torch.bool, device=device))


def _states_equal(a: CompressorState, b: CompressorState):
    for name in ("tail_k", "tail_z", "tail_kb", "tail_zb", "tail_len"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None
            continue
        assert torch.equal(x.cpu(), y.cpu()), name


@pytest.mark.parametrize("kind,ratio", [("csa", 4), ("hca", 8)])
def test_compressor_step_matches_reference(kind, ratio, device):
    cfg = _cfg(kind, ratio)
    width = cfg.head_dim
    state = CompressorState.allocate(cfg.max_slots, ratio, width, cfg.overlap, device)
    expect = state.clone()
    B = 4
    slots, _, active = _batch([0, 3, 1, 4], [0] * 4, [True, True, False, True], device)
    start = torch.tensor([0, 5, 2, ratio - 1], dtype=torch.int32, device=device)
    pooled = torch.zeros((B, width), device=device)
    flush = torch.zeros((B,), dtype=torch.bool, device=device)
    flushed = 0
    for step in range(2 * ratio + 1):
        positions = start + step
        kv = torch.randn((B, state.cols), device=device)
        score = 2 * torch.randn((B, state.cols), device=device)
        ops.compressor_step(state, kv, score, slots, positions, active, pooled, flush)
        want, want_flush = ref.compressor_step(expect, kv.cpu(), score.cpu(), slots.cpu(), positions.cpu(),
                                               active.cpu())
        assert torch.equal(flush.cpu(), want_flush)
        if want_flush.any():
            flushed += 1
            got = pooled.cpu()[want_flush]
            torch.testing.assert_close(got, want[want_flush], rtol=2e-6, atol=2e-6)
        _states_equal(state, expect)
    assert flushed >= 2
    # the inactive row's slot was never touched
    assert torch.equal(state.tail_len[1].cpu(), torch.zeros((), dtype=torch.int32))
    assert torch.isinf(state.tail_z[1]).all()


def _poison(cache):
    for t in cache.pool.tensors():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))


def _pool_bytes(cache):
    return [t.view(torch.uint8).cpu().clone() for t in cache.pool.tensors()]


@pytest.mark.parametrize("kind,numerics", [("csa", NUMERICS[0]), ("csa", NUMERICS[1]), ("hca", NUMERICS[0])])
def test_flush_write_bit_exact_and_masked(kind, numerics, device):
    cfg = _cfg(kind, 4, entry_numerics=numerics[0], index_numerics=numerics[1])
    cache = CompressedKVCache(cfg, device)
    for s in range(cfg.max_slots):
        cache.join(s)
    cache.prepare_forward([0, 1, 2, 3], [0, 0, 0, 0], [40, 40, 40, 40])  # slot 4 keeps no pages
    _poison(cache)
    expect = cache.pool.map(lambda t: t.cpu().clone())
    before = _pool_bytes(cache)
    B = 7
    entry = (3 * torch.randn((B, cfg.head_dim), device=device)).to(torch.bfloat16)
    entry[1] = 0.0                                    # all-zero entry
    entry[2, 5] = float("nan")                        # non-finite element (official: its 64-block only)
    entry[3, :cfg.nope_dim] *= 1e-30                  # tiny values
    entry[6, 64:cfg.nope_dim] *= 1e-3                 # blocks of very different magnitude
    key = (torch.randn((B, cfg.index_head_dim), device=device)).to(torch.bfloat16) if cfg.has_indexer else None
    if key is not None:
        key[4, :16] = 0.0                             # zero block
        key[2, 20] = float("inf")                     # non-finite block
        key[6, 16:32] *= 1e-6                         # tiny block
        key[3, 32:] *= 1e4                            # large block
    slots, positions, _ = _batch([0, 1, 2, 3, 0, 4, 1], [3, 7, 11, 39, 8, 3, 22], [True] * B, device)
    flush = torch.tensor([1, 1, 1, 1, 0, 1, 1], dtype=torch.bool, device=device)  # row 4 masked, row 5: no page
    ops.flush_write(cache.pool, cache.block_table, entry, key, flush, slots, positions, ratio=4)
    ref.flush_write(expect, cache.block_table.cpu(), entry.cpu(), None if key is None else key.cpu(), flush.cpu(),
                    slots.cpu(), positions.cpu(), 4)
    got = _pool_bytes(cache)
    want = [t.view(torch.uint8) for t in expect.tensors()]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # exactly the 5 written entries changed (rows 0,1,2,3,6): poison elsewhere survives
    per_entry = [(g.reshape(g.shape[0] * g.shape[1], -1) != b.reshape(b.shape[0] * b.shape[1], -1)).any(dim=1)
                 for g, b in zip(got, before)]
    assert int(torch.stack(per_entry).any(dim=0).sum()) <= 5
    table = cache.block_table.cpu()
    zero_loc = ref.entry_location(table, 1, 1, cfg.entries_per_block)
    nan_loc = ref.entry_location(table, 2, 2, cfg.entries_per_block)
    scale = expect.entries_scale
    if numerics[0] == "per_entry":
        assert scale[zero_loc].tolist() == [0.0]
        assert torch.isnan(scale[nan_loc]).all()
    else:
        assert scale.shape[-1] == cfg.nope_dim // 64
        assert (scale[zero_loc] == 2.0 ** -22).all()                # pow2ceil(1e-4 / 448)
        assert torch.isnan(scale[nan_loc][0]) and not torch.isnan(scale[nan_loc][1:]).any()
        # stored values are exactly the official act_quant simulation of the finite entries
        for b in (0, 1, 3, 6):
            loc = ref.entry_location(table, int(slots[b]), int(positions[b]) // 4, cfg.entries_per_block)
            got_e = ref.dequantize_entries(expect.entries_fp8[loc], expect.entries_scale[loc], expect.entries_rope[loc])
            want_e = torch.cat([v4.fp8_block_simulate(entry[b, :cfg.nope_dim].cpu(), 64),
                                entry[b, cfg.nope_dim:].cpu()])
            assert torch.equal(got_e.view(torch.int16), want_e.view(torch.int16))
    if key is not None and numerics[1] == "official":
        ks = expect.index_key_scale
        assert ks.dtype == torch.uint8 and ks.shape[-1] == cfg.index_head_dim // 32
        assert ks[nan_loc].tolist() == [0xFF, int(ks[nan_loc][1])] and int(ks[nan_loc][1]) != 0xFF
        assert (expect.index_keys[nan_loc][:16] == 0).all()
        for b in (0, 1, 3, 6):
            loc = ref.entry_location(table, int(slots[b]), int(positions[b]) // 4, cfg.entries_per_block)
            got_k = ref.dequantize_index_keys(expect.index_keys[loc], ks[loc], "official")
            assert torch.equal(got_k, v4.fp4_block_simulate(key[b].cpu().float(), 32))


@pytest.mark.parametrize("numerics", NUMERICS)
def test_gather_entries_bit_exact(numerics, device):
    cfg = _cfg("csa", 4, entry_numerics=numerics[0], index_numerics=numerics[1])
    cache = CompressedKVCache(cfg, device)
    cache.join(0)
    cache.join(2)
    cache.prepare_forward([0, 2], [0, 0], [48, 20])
    B = 17
    entry = torch.randn((B, cfg.head_dim), device=device) * 4
    entry[:, 64:cfg.nope_dim] *= 0.01                     # per-block scales differ
    entry = entry.to(torch.bfloat16)
    key = torch.randn((B, cfg.index_head_dim), device=device).to(torch.bfloat16)
    slot_list = [0] * 12 + [2] * 5
    pos_list = [4 * e + 3 for e in range(12)] + [4 * e + 3 for e in range(5)]
    slots, positions, _ = _batch(slot_list, pos_list, [True] * B, device)
    flush = torch.ones(B, dtype=torch.bool, device=device)
    ops.flush_write(cache.pool, cache.block_table, entry, key, flush, slots, positions, ratio=4)
    q_slots = torch.tensor([0, 2, 0], dtype=torch.int32, device=device)
    indices = torch.tensor([[11, 0, -1, 5, 7, 3, 2, 1, 9, 10, 4, 6, 8, -1, 0, 1, 2, 3],
                            [4, 3, 2, 1, 0, -1, 5, 6, -1, -1, -1, -1, -1, -1, -1, -1, 0, 0],
                            [-1] * 18], dtype=torch.int32, device=device)
    got = ops.gather_entries(cache.pool, cache.block_table, q_slots, indices)
    pool_cpu = cache.pool.map(lambda t: t.cpu())
    want = ref.gather_entries(pool_cpu, cache.block_table.cpu(), q_slots.cpu(), indices.cpu())
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    # RoPE half exactly as written, FP8 half within E4M3 rounding of the bf16 input
    e0 = got[0, 0].cpu().float()
    src = entry[11].cpu().float()
    assert torch.equal(e0[cfg.nope_dim:], src[cfg.nope_dim:])
    if numerics[0] == "official":
        assert torch.equal(e0[:cfg.nope_dim], v4.fp8_block_simulate(src[:cfg.nope_dim], 64))
    amax = src[:cfg.nope_dim].abs().max()
    assert ((e0[:cfg.nope_dim] - src[:cfg.nope_dim]).abs() <= 2 ** -4 * src[:cfg.nope_dim].abs() + amax / 448 * 2 ** -9
            + 1e-2 * src[:cfg.nope_dim].abs()).all()
    assert (got[2].float() == 0).all()


@pytest.mark.parametrize("index_numerics", ["official", "nvfp4"])
def test_indexer_scores_and_topk(index_numerics, device):
    cfg = _cfg("csa", 4, index_numerics=index_numerics)
    cache = CompressedKVCache(cfg, device)
    for s in (0, 1, 3):
        cache.join(s)
    n_list = [37, 5, 0]
    cache.prepare_forward([0, 1, 3], [0, 0, 0], [4 * n for n in n_list])
    rows_slot, rows_pos = [], []
    for s, n in zip((0, 1, 3), n_list):
        rows_slot += [s] * n
        rows_pos += [4 * e + 3 for e in range(n)]
    R = len(rows_slot)
    entry = torch.randn((R, cfg.head_dim), device=device).to(torch.bfloat16)
    key = torch.randn((R, cfg.index_head_dim), device=device)
    key = (key * torch.logspace(-2, 2, R, device=device)[:, None]).to(torch.bfloat16)   # scales vary by entry
    key[:, :32] *= 8                                                                       # and by block
    slots, positions, _ = _batch(rows_slot, rows_pos, [True] * R, device)
    ops.flush_write(cache.pool, cache.block_table, entry, key, torch.ones(R, dtype=torch.bool, device=device),
                    slots, positions, ratio=4)
    B, H = 4, cfg.index_n_heads
    q = torch.randn((B, H, cfg.index_head_dim), device=device).to(torch.bfloat16)
    weights = torch.randn((B, H), device=device)
    q_slots = torch.tensor([0, 1, 3, 0], dtype=torch.int32, device=device)
    n_entries = torch.tensor([37, 5, 0, 20], dtype=torch.int32, device=device)
    T = 40
    scores = torch.empty((B, T), device=device)
    ops.indexer_scores(cache.pool, cache.block_table, q, weights, q_slots, n_entries, scores)
    pool_cpu = cache.pool.map(lambda t: t.cpu())
    want = ref.indexer_scores(pool_cpu, cache.block_table.cpu(), q.cpu(), weights.cpu(), q_slots.cpu(),
                              n_entries.cpu(), T)
    got = scores.cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4 * float(want[finite].abs().max()))
    # the reference decodes keys independently: a wrong nibble order or scale would move scores by O(1)
    assert (want[finite].abs() > 1e-3).float().mean() > 0.3
    topk = ops.select_topk(scores, cfg.index_topk).cpu()
    assert torch.equal(topk, ref.select_topk(want, cfg.index_topk))
    assert (topk[2] == -1).all() and (topk[1, 5:] == -1).all() and (topk[1, :5] >= 0).all()


def test_select_topk_tie_break():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0, 3.0]])
    assert ref.select_topk(scores, 5).tolist() == [[1, 2, 5, 4, 0]]
    assert ref.select_topk(scores, 10).tolist() == [[1, 2, 5, 4, 0, -1]]


def test_swa_append(device):
    cfg = _cfg("hca", 8)
    cache = CompressedKVCache(cfg, device)
    before = cache.swa.cpu().clone()
    want = before.clone()
    kv = torch.randn((4, cfg.head_dim), device=device).to(torch.bfloat16)
    slots, positions, active = _batch([0, 2, 1, 4], [3, 17, 5, 8], [True, True, False, True], device)
    ops.swa_append(cache.swa_rows, cfg.window_size, kv, slots, positions, active)
    ref.swa_append(want, kv.cpu(), slots.cpu(), positions.cpu(), active.cpu())
    assert torch.equal(cache.swa.cpu(), want)
    assert torch.equal(cache.swa[1].cpu(), before[1])


def test_prepare_forward_allocation():
    cfg = _cfg("csa", 4, entries_per_block=4, max_context=64, max_slots=2, num_blocks=5)
    cache = CompressedKVCache(cfg, "cpu")
    cache.join(0)
    cache.prepare_forward([0], [0], [15])          # 3 entries -> 1 page
    assert (cache.block_table[0] >= 0).sum() == 1
    cache.prepare_forward([0], [15], [16])         # 4 entries -> still 1 page
    assert (cache.block_table[0] >= 0).sum() == 1
    cache.prepare_forward([0], [16], [17])
    cache.prepare_forward([0], [17], [20])         # 5 entries -> 2 pages
    assert (cache.block_table[0] >= 0).sum() == 2
    cache.join(1)
    cache.prepare_forward([1], [0], [48])          # 12 entries -> 3 pages
    assert cache.allocator.num_free == 0
    with pytest.raises(RuntimeError):
        cache.prepare_forward([1], [48], [52])
    cache.leave(0)
    assert cache.allocator.num_free == 2 and (cache.block_table[0] == -1).all()
    with pytest.raises(ValueError):
        cache.prepare_forward([0], [5], [4])
    with pytest.raises(ValueError):
        cache.prepare_forward([7], [0], [4])


def test_validation_errors():
    cfg = _cfg("csa", 4)
    cache = CompressedKVCache(cfg, "cpu")
    slots, positions, active = _batch([0], [0], [True], "cpu")
    pooled = torch.zeros((1, cfg.head_dim))
    flush = torch.zeros((1,), dtype=torch.bool)
    with pytest.raises(TypeError, match="kv"):
        ops.compressor_step(cache.state, torch.zeros((1, 2 * cfg.head_dim), dtype=torch.bfloat16),
                            torch.zeros((1, 2 * cfg.head_dim)), slots, positions, active, pooled, flush)
    with pytest.raises(ValueError, match="score"):
        ops.compressor_step(cache.state, torch.zeros((1, 2 * cfg.head_dim)), torch.zeros((1, cfg.head_dim)),
                            slots, positions, active, pooled, flush)
    with pytest.raises(TypeError, match="positions"):
        ops.compressor_step(cache.state, torch.zeros((1, 2 * cfg.head_dim)), torch.zeros((1, 2 * cfg.head_dim)),
                            slots, positions.long(), active, pooled, flush)
    with pytest.raises(ValueError, match="index_key"):
        ops.flush_write(cache.pool, cache.block_table, torch.zeros((1, cfg.head_dim), dtype=torch.bfloat16), None,
                        flush, slots, positions, ratio=4)
    with pytest.raises(ValueError, match="kind"):
        CompressedCacheConfig(kind="mla")
    with pytest.raises(ValueError, match="rope_dim"):
        CompressedCacheConfig(head_dim=64, rope_dim=64)


def test_select_topk_matches_stable_sort(device):
    for _ in range(20):
        T = int(torch.randint(1, 70, ()))
        scores = torch.randint(-3, 4, (4, T)).float() * torch.rand(())
        scores[scores == 3 * scores.max()] = float("-inf")
        scores[torch.rand(4, T) < 0.2] = float("-inf")
        scores[torch.rand(4, T) < 0.1] = -0.0
        k = int(torch.randint(1, 80, ()))
        got = ref.select_topk(scores.to(device), k).cpu()
        assert torch.equal(got, ref.select_topk_sorted(scores, k))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_empty_batch_is_a_no_op(kind, device):
    cfg = _cfg(kind, 4)
    cache = CompressedKVCache(cfg, device)
    before = _pool_bytes(cache)
    e32 = torch.zeros((0,), dtype=torch.int32, device=device)
    eb = torch.zeros((0,), dtype=torch.bool, device=device)
    C = 2 if cfg.overlap else 1
    ops.compressor_step(cache.state, torch.zeros((0, C * cfg.head_dim), device=device),
                        torch.zeros((0, C * cfg.head_dim), device=device), e32, e32, eb,
                        torch.zeros((0, cfg.head_dim), device=device), eb.clone())
    key = torch.zeros((0, cfg.index_head_dim), dtype=torch.bfloat16, device=device) if cfg.has_indexer else None
    ops.flush_write(cache.pool, cache.block_table, torch.zeros((0, cfg.head_dim), dtype=torch.bfloat16, device=device),
                    key, eb, e32, e32, ratio=4)
    out = ops.gather_entries(cache.pool, cache.block_table, e32, torch.zeros((0, 3), dtype=torch.int32, device=device))
    assert out.shape == (0, 3, cfg.head_dim)
    if cfg.has_indexer:
        scores = torch.zeros((0, 10), device=device)
        ops.indexer_scores(cache.pool, cache.block_table,
                           torch.zeros((0, cfg.index_n_heads, cfg.index_head_dim), dtype=torch.bfloat16, device=device),
                           torch.zeros((0, cfg.index_n_heads), device=device), e32, e32, scores)
        assert ops.select_topk(scores, 4).shape == (0, 4)
    else:
        with pytest.raises(ValueError, match="indexer"):
            ops.indexer_scores(cache.pool, cache.block_table, torch.zeros((0, 16, 32), dtype=torch.bfloat16),
                               torch.zeros((0, 16)), e32, e32, torch.zeros((0, 10)))
    assert all(torch.equal(a, b) for a, b in zip(_pool_bytes(cache), before))
