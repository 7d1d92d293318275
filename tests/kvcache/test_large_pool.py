"""Compressed-cache kernels on a pool past 2 GiB: flush, indexer scores, gather and attention address it in int64.

A V4 layer's FP8 entry pool passes 2**31 bytes at ~4.8M entries (448 bytes each): for CSA (one entry per 4 tokens)
that is, for example, 150 requests of 128k tokens. A kernel that forms ``page * EPB * nope`` in int32 would wrap
there and read or write another request's rows without any error. The CPU tests cannot see it (their pools are
small), so these CUDA tests put the same cache contents at the top of a pool whose FP8 part is just over 2 GiB and
require the same bits as from a small pool that holds only those pages: every written page, every score, every
gathered row and every attention output. Memory: ~3.2 GB of pool.
"""
from __future__ import annotations

import pytest
import torch

from megamoe.ops import attention as attention_ops
from megamoe.kernels.sparse_attention import launch_sparse_mqa_attention
from megamoe.kvcache import ops as kv_ops
from megamoe.kvcache.state import PagedPool

EPB, NOPE, ROPE, KEY_DIM = 64, 448, 64, 128
HEADS, INDEX_HEADS, WINDOW, RATIO = 64, 64, 128, 4
SLOTS, PAGES_PER_SLOT = 4, 4
SMALL_PAGES = SLOTS * PAGES_PER_SLOT + 2
BIG_PAGES = 2 ** 31 // (EPB * NOPE) + 64  # the FP8 part of the pool ends past 2 GiB
BASE = BIG_PAGES - SMALL_PAGES           # small page p is big page BASE + p: all of them past 2**31 bytes


def _pool(pages: int, device) -> PagedPool:
    def zeros(cols, dtype):
        return torch.zeros(pages, EPB, cols, dtype=dtype, device=device)

    return PagedPool(zeros(NOPE, torch.float8_e4m3fn), zeros(NOPE // 64, torch.float32), zeros(ROPE, torch.bfloat16),
                     zeros(KEY_DIM // 2, torch.uint8), zeros(KEY_DIM // 32, torch.uint8), "official", "official")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def pools():
    """(small pool, its table, big pool, its table, entries per slot), both written by the same flushes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(20261128)
    small, big = _pool(SMALL_PAGES, dev), _pool(BIG_PAGES, dev)
    assert big.entries_fp8.numel() > 2 ** 31 and BASE * EPB * NOPE > 2 ** 31
    table = torch.randperm(SMALL_PAGES, generator=gen, device=dev)[:SLOTS * PAGES_PER_SLOT].to(torch.int32)
    table = table.view(SLOTS, PAGES_PER_SLOT).contiguous()
    big_table = table + BASE
    entries = PAGES_PER_SLOT * EPB
    rows = SLOTS * entries
    entry = torch.randn(rows, NOPE + ROPE, generator=gen, device=dev).to(torch.bfloat16)
    index_key = torch.randn(rows, KEY_DIM, generator=gen, device=dev).to(torch.bfloat16)
    slots = torch.arange(SLOTS, device=dev, dtype=torch.int32).repeat_interleave(entries)
    positions = (torch.arange(entries, device=dev, dtype=torch.int32) * RATIO + RATIO - 1).repeat(SLOTS)
    flush = torch.ones(rows, dtype=torch.bool, device=dev)
    for pool, t in ((small, table), (big, big_table)):
        kv_ops.flush_write(pool, t, entry, index_key, flush, slots, positions, ratio=RATIO)
    torch.cuda.synchronize()
    yield small, table, big, big_table, entries
    del big
    torch.cuda.empty_cache()


@pytest.mark.cuda
def test_cuda_flush_writes_the_same_pages_past_2gib(pools):
    small, _, big, _, _ = pools
    for name in ("entries_fp8", "entries_scale", "entries_rope", "index_keys", "index_key_scale"):
        want, got = getattr(small, name), getattr(big, name)[BASE:]
        assert torch.equal(_bits(got), _bits(want)), name
        assert bool((_bits(want) != 0).any()), name  # the flush wrote something to compare
    assert not bool((_bits(big.entries_fp8[:BASE]) != 0).any())  # and nothing below the pages it owns


@pytest.mark.cuda
def test_cuda_indexer_scores_and_gather_past_2gib(pools):
    small, table, big, big_table, entries = pools
    dev = table.device
    gen = torch.Generator(device=dev).manual_seed(7)
    B = SLOTS
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    q = torch.randn(B, INDEX_HEADS, KEY_DIM, generator=gen, device=dev).to(torch.bfloat16)
    weights = torch.rand(B, INDEX_HEADS, generator=gen, device=dev) * INDEX_HEADS ** -0.5
    n_entries = torch.tensor([entries, entries - 5, 1, entries], device=dev, dtype=torch.int32)
    want = kv_ops.indexer_scores(small, table, q, weights, slots, n_entries, torch.empty(B, entries, device=dev))
    got = kv_ops.indexer_scores(big, big_table, q, weights, slots, n_entries, torch.empty(B, entries, device=dev))
    assert torch.equal(got, want)
    assert bool(torch.isfinite(want).any())
    indices = torch.randint(-1, entries, (B, 96), generator=gen, device=dev, dtype=torch.int32)
    want = kv_ops.gather_entries(small, table, slots, indices)
    got = kv_ops.gather_entries(big, big_table, slots, indices)
    assert torch.equal(_bits(got), _bits(want)) and bool((want != 0).any())


@pytest.mark.cuda
@pytest.mark.parametrize("impl", [None, "v1", "ws", "ws3"])
def test_cuda_attention_past_2gib(pools, impl):
    """Decode attention (window + 256 selected entries per query, two queries per request) over both pools: the
    same bits; ``None`` is the public op (the default kernel)."""
    small, table, big, big_table, entries = pools
    dev = table.device
    gen = torch.Generator(device=dev).manual_seed(11)
    N, D = 2 * SLOTS, NOPE + ROPE
    q = torch.randn(N, HEADS, D, generator=gen, device=dev).to(torch.bfloat16)
    sink = torch.randn(HEADS, generator=gen, device=dev)
    window_kv = torch.randn(SLOTS * WINDOW + 1, D, generator=gen, device=dev).to(torch.bfloat16)
    window_idx = torch.randint(-1, SLOTS * WINDOW, (N, WINDOW), generator=gen, device=dev, dtype=torch.int32)
    slots = torch.arange(SLOTS, device=dev, dtype=torch.int32).repeat(2)
    entry_idx = torch.randint(-1, entries, (N, 256), generator=gen, device=dev, dtype=torch.int32)
    outs = []
    for pool, t in ((small, table), (big, big_table)):
        kw = dict(window_kv=window_kv, window_idx=window_idx, entries_fp8=pool.entries_fp8,
                  entries_scale=pool.entries_scale, entries_rope=pool.entries_rope, block_table=t, slots=slots,
                  entry_idx=entry_idx)
        if impl is None:
            outs.append(attention_ops.sparse_mqa_attention(q, sink, D ** -0.5, **kw))
        else:
            out = torch.empty_like(q)
            launch_sparse_mqa_attention(q, sink, D ** -0.5, *kw.values(), out, impl=impl)
            outs.append(out)
    want, got = outs
    assert torch.equal(_bits(got), _bits(want))
    assert bool(torch.isfinite(want.float()).all()) and bool((want != 0).any())
