"""Fused indexer scores + top-k (megamoe.kvcache.ops.indexer_topk, v3): the scoring kernel writes per-tile
maxima into the top-k workspace and the split top-k skips its row-maximum pass. Same scores and the same
indices as indexer_scores + select_topk, on a batch of mixed lengths (-inf tails, an empty row), with the
workspace reused across calls; the per-tile maxima are checked against the scores."""
import pytest
import torch

import megamoe.reference.kvcache as ref
from megamoe.kernels import topk as kt
from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache, ops
from megamoe.ops._dispatch import interpreter_enabled
from sync_helpers import no_host_syncs

SMALL = dict(head_dim=144, rope_dim=16, index_head_dim=64, index_n_heads=16, index_topk=8, window_size=8,
             entries_per_block=16, max_slots=4, max_context=1024)


def _ordered(x):
    bits = (x + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@pytest.mark.parametrize("k", [5, 40])
def test_indexer_topk_fused_matches_unfused(device, k):
    cfg = CompressedCacheConfig(kind="csa", ratio=4, **SMALL)
    cache = CompressedKVCache(cfg, device)
    n_list = [256, 200, 0]
    for s in range(3):
        cache.join(s)
    cache.prepare_forward([0, 1, 2], [0, 0, 0], [4 * n for n in n_list])
    p = cache.pool
    p.index_keys.random_(0, 256)
    p.index_key_scale.random_(120, 131)
    B, H, T = 3, cfg.index_n_heads, 256
    q = torch.randn((B, H, cfg.index_head_dim), device=device).to(torch.bfloat16)
    w = torch.randn((B, H), device=device)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    n = torch.tensor(n_list, dtype=torch.int32, device=device)
    interp = interpreter_enabled() and device.type != "cuda"
    plan = kt.plan_for(B, T, k, interpreter=interp, num_sms=kt.DEFAULT_SMS if interp else kt._num_sms(device))
    if interp:
        assert plan.path == "split"  # the fused path (tile maxima) is exercised
    want_scores = torch.empty((B, T), device=device)
    ops.indexer_scores(p, cache.block_table, q, w, slots, n, want_scores)
    want = ref.select_topk(want_scores.cpu(), k)
    ws = torch.zeros((B, kt.workspace_entries(T, k, interpreter=interp, batch=B)), dtype=torch.int32, device=device)
    for _ in range(2):  # the workspace is reused (arrival counters back at zero)
        scores = torch.full((B, T), 7.0, device=device)
        out = ops.indexer_topk(p, cache.block_table, q, w, slots, n, scores, k, workspace=ws)
        assert torch.equal(scores, want_scores)
        assert torch.equal(out.cpu(), want)
        if ws.shape[1]:  # the split path's arrival counters (a GPU plan at this size needs no workspace)
            assert bool((ws[:, 0] == 0).all())
    assert (out[2] == -1).all() and (out[1] >= 0).all()
    if plan.path == "split":
        # tile maxima written by the scoring kernel: the maximum order-preserving key of each tile
        from megamoe.kernels.kvcache.indexer import BLOCK_T

        blk = BLOCK_T["interpreter" if interp else "gpu"]
        nt = T // blk
        tiles = ws[:, kt.tile_maxima_offset():kt.tile_maxima_offset() + nt].cpu()
        assert torch.equal(tiles, _ordered(want_scores.cpu()).view(B, nt, blk).amax(-1))
    # without a workspace (allocated inside) and through select_topk's semantics
    assert torch.equal(ops.indexer_topk(p, cache.block_table, q, w, slots, n, scores, k).cpu(), want)
    if ws.shape[1] > 10:
        with pytest.raises(ValueError, match="workspace"):
            ops.indexer_topk(p, cache.block_table, q, w, slots, n, scores, k, workspace=ws[:, :10].contiguous())
    with pytest.raises(ValueError, match="k"):
        ops.indexer_topk(p, cache.block_table, q, w, slots, n, scores, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("B,context,k", [(1, 131072, 512), (1, 32768, 1024), (8, 32768, 512), (2, 4096, 512)])
def test_cuda_indexer_topk_graph_and_sync_free(B, context, k):
    """V4 shapes on the GPU: fused scores + top-k == reference, sync-free eager call, graph replay == eager."""
    dev = torch.device("cuda")
    cfg = CompressedCacheConfig(kind="csa", max_slots=B, max_context=context, entries_per_block=64)
    cache = CompressedKVCache(cfg, dev)
    for s in range(B):
        cache.join(s)
    T = cfg.max_entries
    cache.prepare_forward(list(range(B)), [0] * B, [T * cfg.ratio] * B)
    cache.pool.index_keys.random_(0, 256)
    cache.pool.index_key_scale.random_(120, 131)
    H = cfg.index_n_heads
    q = torch.randn((B, H, cfg.index_head_dim), device=dev).to(torch.bfloat16)
    w = torch.randn((B, H), device=dev)
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    n = torch.full((B,), T, dtype=torch.int32, device=dev)
    n[0] = T - 1000  # mixed lengths: a -inf tail
    scores = torch.empty((B, T), device=dev)
    out = torch.empty((B, min(k, T)), dtype=torch.int32, device=dev)
    ws = torch.zeros((B, max(1, kt.workspace_entries(T, k, batch=B))), dtype=torch.int32, device=dev)
    args = (cache.pool, cache.block_table, q, w, slots, n, scores, k)
    ops.indexer_topk(*args, out=out, workspace=ws)  # compile outside the checks
    torch.cuda.synchronize()
    with no_host_syncs():
        ops.indexer_topk(*args, out=out, workspace=ws)
    eager = out.clone()
    assert torch.equal(eager, ref.select_topk(scores, k))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.indexer_topk(*args, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.indexer_topk(*args, out=out, workspace=ws)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q.copy_(torch.randn_like(q.float()).to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref.select_topk(scores, k))
