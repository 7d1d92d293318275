"""Side-by-side decode simulation: the paged kernel path vs the float32 reference (no paging, no tails).

Used by the tests (small dims on CPU through the interpreter; full V4 dims on the GPU, with the step
captured in a CUDA graph) and by the benchmark's sanity check. A batch of ``batch`` rows hosts requests
that join at random start positions (their earlier entries written by a prefill flush-write), decode for
a random number of steps and leave; rows without a request are inactive padding. After every step it
checks, for each live request:

* tail state (a/b streams, tail length) == the reference's expected tails, exactly;
* the new entries read back by the dequantizing reader: RoPE dims == the bf16 of the pooled entry the
  kernel produced (exactly) and within one bf16 ulp of the reference's; FP8 dims within E4M3 rounding
  of the reference entry (|err| <= (2**-4 + 2**-7) |ref| + scale * 2**-9);
* the pool bytes changed only at the entries flushed this step (inactive rows are no-ops);
* CSA: the selected top-k indices == the reference's (which scores its own reference-quantized keys in
  float64), position by position; a difference is tolerated (and counted in ``topk_near_tie_swaps``) only
  between two entries whose reference scores agree within 1e-5 of the largest |score|.
"""
from __future__ import annotations

import random

import torch

from ..reference import kvcache as ref
from . import ops
from .cache import CompressedKVCache, DecodeBatch
from .config import CompressedCacheConfig


def _entry_bytes(cache: CompressedKVCache) -> torch.Tensor:
    """(pages * epb,) bool-able digest input: every pool tensor's bytes per entry, concatenated."""
    parts = [t.view(torch.uint8).reshape(t.shape[0] * t.shape[1], -1) for t in cache.pool.tensors()]
    return torch.cat(parts, dim=1)


def _bf16_ulp_close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ai = a.view(torch.int16).to(torch.int32)
    bi = b.view(torch.int16).to(torch.int32)
    return (ai - bi).abs() <= 1


def run_side_by_side(config: CompressedCacheConfig, *, steps: int, batch: int, device, seed: int = 0,
                     graph: bool = False, check_every: int = 1) -> dict:
    """Run the simulation; raises AssertionError on the first mismatch. Returns counters.

    graph=True (CUDA only): a second cache is driven by one captured CUDA graph of ``decode_step`` and
    must equal the eager cache bit for bit after every step; the eager step runs under
    ``torch.cuda.set_sync_debug_mode("error")``.
    """
    device = torch.device(device)
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    c = config
    if c.max_slots < batch:
        raise ValueError("config.max_slots must be >= batch")
    C = 2 if c.overlap else 1
    cache = CompressedKVCache(c, device, batch=batch)
    for t in cache.pool.tensors():  # poison: untouched entries must keep these bytes
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    sim = ref.ReferenceDecodeSim(ratio=c.ratio, head_dim=c.head_dim, rope_dim=c.rope_dim,
                                 index_head_dim=c.index_head_dim if c.has_indexer else None,
                                 overlap=c.overlap, window=c.window_size)
    dbatch = DecodeBatch.allocate(batch, device)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(device)

    H, Di, D = c.index_n_heads, c.index_head_dim, c.head_dim
    inputs = {
        "kv": torch.zeros((batch, C * D), device=device),
        "score": torch.zeros((batch, C * D), device=device),
        "swa_kv": torch.zeros((batch, D), dtype=torch.bfloat16, device=device),
    }
    if c.has_indexer:
        inputs.update(index_kv=torch.zeros((batch, C * Di), device=device),
                      index_score=torch.zeros((batch, C * Di), device=device),
                      q=torch.zeros((batch, H, Di), dtype=torch.bfloat16, device=device),
                      weights=torch.zeros((batch, H), device=device))

    gcache = graph_obj = gtopk = None
    if graph:
        gcache = CompressedKVCache(c, device, batch=batch)
        for src, dst in zip(cache.pool.tensors(), gcache.pool.tensors()):
            dst.copy_(src)
        gbatch = DecodeBatch.allocate(batch, device)
        # warm up (compiles kernels) on a side stream with all rows inactive, then capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gcache.decode_step(gbatch, **inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph_obj = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_obj):
            gtopk = gcache.decode_step(gbatch, **inputs)

    rows = [None] * batch          # request id per row
    life = [0] * batch
    next_rid = 0
    stats = {"steps": 0, "flushes": 0, "entries_checked": 0, "topk_checked": 0, "topk_exact": 0,
             "topk_near_tie_swaps": 0, "rope_ulp_diffs": 0,
             "joins": 0, "leaves": 0}
    for step in range(steps):
        # ---- host side: requests leave / join, pages for this step (outside the graph)
        for r in range(batch):
            if rows[r] is not None and life[r] <= 0:
                cache.leave(r)
                if gcache is not None:
                    gcache.leave(r)
                sim.leave(rows[r])
                rows[r] = None
                stats["leaves"] += 1
            if rows[r] is None and rng.random() < 0.5:
                rid, next_rid = next_rid, next_rid + 1
                start = rng.randrange(0, 12 * c.ratio)
                n_pre = start // c.ratio
                pre_entries = randn(n_pre, D, scale=2.0).to(torch.bfloat16)
                pre_keys = randn(n_pre, Di).to(torch.bfloat16) if c.has_indexer else None
                for cc in (cache, gcache):
                    if cc is None:
                        continue
                    cc.join(r)
                    cc.prepare_forward([r], [0], [start])
                    if n_pre:  # prefill: a batch of rows of the same slot through the flush-write kernel
                        sl = torch.full((n_pre,), r, dtype=torch.int32, device=device)
                        ps = (torch.arange(n_pre, dtype=torch.int32, device=device) * c.ratio + c.ratio - 1)
                        ops.flush_write(cc.pool, cc.block_table, pre_entries, pre_keys,
                                        torch.ones(n_pre, dtype=torch.bool, device=device), sl, ps, ratio=c.ratio)
                sim.join(rid, start, pre_entries.cpu().clone(), None if pre_keys is None else pre_keys.cpu().clone())
                rows[r] = rid
                life[r] = rng.randrange(1, 6 * c.ratio)
                stats["joins"] += 1
        active = [rows[r] is not None for r in range(batch)]
        positions = [sim.requests[rows[r]]["pos"] if active[r] else 0 for r in range(batch)]
        live = [r for r in range(batch) if active[r]]
        for cc in (cache, gcache):
            if cc is not None:
                cc.prepare_forward(live, [positions[r] for r in live], [positions[r] + 1 for r in live])
        dbatch.set(list(range(batch)), positions, active)

        # ---- inputs
        inputs["kv"].copy_(randn(batch, C * D))
        inputs["score"].copy_(randn(batch, C * D, scale=2.0))
        inputs["swa_kv"].copy_(randn(batch, D).to(torch.bfloat16))
        if c.has_indexer:
            inputs["index_kv"].copy_(randn(batch, C * Di))
            inputs["index_score"].copy_(randn(batch, C * Di, scale=2.0))
            inputs["q"].copy_(randn(batch, H, Di).to(torch.bfloat16))
            inputs["weights"].copy_(randn(batch, H))
        before = _entry_bytes(cache).clone()

        # ---- kernel path (eager), then the graph replay
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            topk = cache.decode_step(dbatch, **inputs)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if graph_obj is not None:
            gbatch.slots.copy_(dbatch.slots)
            gbatch.positions.copy_(dbatch.positions)
            gbatch.active.copy_(dbatch.active)
            graph_obj.replay()
            torch.cuda.synchronize()
            for a, b in zip(cache.pool.tensors(), gcache.pool.tensors()):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "graph replay != eager (pool)"
            for s1, s2 in ((cache.state, gcache.state), (cache.index_state, gcache.index_state)):
                if s1 is None:
                    continue
                for name in ("tail_k", "tail_z", "tail_kb", "tail_zb", "tail_len"):
                    a, b = getattr(s1, name), getattr(s2, name)
                    assert a is None or torch.equal(a, b), f"graph replay != eager ({name})"
            assert torch.equal(cache.swa, gcache.swa), "graph replay != eager (swa)"
            if topk is not None:
                assert torch.equal(topk, gtopk), "graph replay != eager (top-k)"

        # ---- reference
        flushed_locs = set()
        table = cache.block_table.cpu()
        flush_dev = cache.workspace["flush"].cpu()
        entry_dev = cache.workspace["entry"].cpu().clone()
        for r in live:
            rid = rows[r]
            host = {k: v[r].cpu().clone() for k, v in inputs.items()}  # .cpu() of a CPU tensor is no copy
            flushed = sim.step(rid, host["kv"], host["score"], host["swa_kv"], host.get("index_kv"),
                               host.get("index_score"))
            life[r] -= 1
            assert bool(flush_dev[r]) == flushed, f"step {step} row {r}: flush flag"
            # tails
            for st, width, key in ((cache.state, D, "history"), (cache.index_state, Di, "index_history")):
                if st is None:
                    continue
                k, z, kb, zb, n = sim.expected_tails(rid, width, key)
                assert torch.equal(st.tail_k[r].cpu(), k), f"step {step} row {r}: tail_k"
                assert torch.equal(st.tail_z[r].cpu(), z), f"step {step} row {r}: tail_z"
                if kb is not None:
                    assert torch.equal(st.tail_kb[r].cpu(), kb), f"step {step} row {r}: tail_kb"
                    assert torch.equal(st.tail_zb[r].cpu(), zb), f"step {step} row {r}: tail_zb"
                assert int(st.tail_len[r]) == n, f"step {step} row {r}: tail_len"
            # SWA row
            assert torch.equal(cache.swa[r, positions[r] % c.window_size].cpu(), inputs["swa_kv"][r].cpu())
            if flushed:
                stats["flushes"] += 1
                e = positions[r] // c.ratio
                flushed_locs.add(ref.entry_location(table, r, e, c.entries_per_block))
                got = ops.gather_entries(cache.pool, cache.block_table,
                                         torch.tensor([r], dtype=torch.int32, device=device),
                                         torch.tensor([[e]], dtype=torch.int32, device=device))[0, 0].cpu()
                want_raw = sim.requests[rid]["raw"][e]
                nope = c.nope_dim
                assert torch.equal(got[nope:], entry_dev[r, nope:]), f"step {step} row {r}: rope != stored"
                close = _bf16_ulp_close(got[nope:], want_raw[nope:])
                assert bool(close.all()), f"step {step} row {r}: rope differs from reference by > 1 ulp"
                stats["rope_ulp_diffs"] += int((got[nope:].view(torch.int16) != want_raw[nope:].view(torch.int16)).sum())
                g, w = got[:nope].float(), want_raw[:nope].float()
                scale = w.abs().max() / 448
                tol = (2 ** -4 + 2 ** -7) * w.abs() + scale * 2 ** -9 + 1e-30
                assert bool(((g - w).abs() <= tol).all()), f"step {step} row {r}: FP8 entry off the reference"
                stats["entries_checked"] += 1
            if topk is not None:
                ref_scores = sim.scores(rid, host["q"], host["weights"], c.max_entries)
                want_idx = ref.select_topk(ref_scores[None], c.index_topk)[0]
                got_idx = topk[r].cpu()
                stats["topk_checked"] += 1
                if torch.equal(got_idx, want_idx):
                    stats["topk_exact"] += 1
                else:
                    # Allowed only: swaps between entries whose reference scores agree to float32 summation
                    # noise (the kernel sums in float32, the reference in float64).
                    tol = 1e-5 * float(ref_scores[torch.isfinite(ref_scores)].abs().max())
                    got_set = set(got_idx.tolist()) - {-1}
                    want_set = set(want_idx.tolist()) - {-1}
                    assert len(got_set) == len(want_set), f"step {step} row {r}: top-k size"
                    for a, b in zip(got_idx.tolist(), want_idx.tolist()):
                        if a != b:
                            assert a >= 0 and b >= 0 and abs(float(ref_scores[a] - ref_scores[b])) <= tol, (
                                f"step {step} row {r}: top-k {got_idx.tolist()} != {want_idx.tolist()}")
                    stats["topk_near_tie_swaps"] += 1
        if check_every and step % check_every == 0:
            after = _entry_bytes(cache)
            changed = (after != before).any(dim=1).nonzero().flatten().tolist()
            allowed = {p * c.entries_per_block + s for (p, s) in flushed_locs}
            assert set(changed) <= allowed, f"step {step}: pool entries {set(changed) - allowed} changed"
        if topk is not None:
            for r in range(batch):
                if not active[r]:
                    assert bool((topk[r] == -1).all()), f"step {step}: inactive row {r} selected entries"
        stats["steps"] += 1
    return stats
