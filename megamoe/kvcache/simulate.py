"""Side-by-side decode simulation: the paged kernel path vs the float32 reference (no paging, no tails).

Used by the tests (small dims on CPU through the interpreter; full V4 dims on the GPU, with the step
captured in a CUDA graph) and by the benchmark's sanity check. A batch of ``batch`` rows hosts requests
that join with a prompt of random length (usually not a multiple of the ratio) written by
:meth:`CompressedKVCache.prefill`, decode for a random number of steps and leave; rows without a request
are inactive padding. The post-pool steps (RMSNorm, YaRN RoPE, indexer Hadamard) are on, with random norm
weights, and the cache's configured numerics are used on both sides. After the prefill and after every
step it checks, for each live request:

* tail state (a/b streams, tail length) == the reference's expected tails, exactly;
* the new entries read back by the dequantizing reader: RoPE dims == the kernel's post-pool bf16 entry
  (exactly) and close to the reference's (the pooled float32 differs at summation-order level before the
  bf16 cast); FP8 dims within E4M3 rounding of the reference's quantized entry (bit-exact entries counted);
* CSA: the stored indexer key within FP4 rounding of the reference key (bit-exact keys counted);
* the pool bytes changed only at the entries flushed this step (inactive rows are no-ops);
* CSA: the selected top-k indices == the top-k of float64 scores of the stored keys, position by position;
  a difference is tolerated (``topk_near_tie_swaps``) only between entries whose reference scores agree
  within 1e-5 of the largest |score|. ``topk_ref_keys_exact`` counts steps whose top-k also equals the
  top-k over the reference's own keys (not asserted: a one-ulp bf16 difference can move an FP4 code).
"""
from __future__ import annotations

import random

import torch

from ..reference import kvcache as ref
from ..reference.v4_numerics import rope_frequencies
from . import ops
from .cache import CompressedKVCache, DecodeBatch
from .config import ENTRY_SCALE_BLOCK, INDEX_SCALE_BLOCK, CompressedCacheConfig


def _entry_bytes(cache: CompressedKVCache) -> torch.Tensor:
    """(pages * epb, bytes) uint8: every pool tensor's bytes per entry, concatenated."""
    parts = [t.view(torch.uint8).reshape(t.shape[0] * t.shape[1], -1) for t in cache.pool.tensors()]
    return torch.cat(parts, dim=1)


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element amax of its ``block``-wide block (x 1-D, len a multiple of block)."""
    return x.abs().unflatten(0, (-1, block)).amax(-1).repeat_interleave(block)


def sim_post_pool_params(config: CompressedCacheConfig, gen: torch.Generator):
    """Random norm weights (around 1) and a YaRN RoPE table for the simulation (CPU tensors)."""
    c = config
    norm = 1.0 + 0.2 * torch.randn(c.head_dim, generator=gen)
    index_norm = (1.0 + 0.2 * torch.randn(c.index_head_dim, generator=gen)) if c.has_indexer else None
    freqs = rope_frequencies(c.rope_dim, c.max_context, base=40000.0, original_seq_len=max(c.max_context // 8, 16),
                             factor=4.0)
    return norm, freqs, index_norm


def run_side_by_side(config: CompressedCacheConfig, *, steps: int, batch: int, device, seed: int = 0,
                     graph: bool = False, check_every: int = 1, max_prompt: int | None = None) -> dict:
    """Run the simulation; raises AssertionError on the first mismatch. Returns counters.

    max_prompt: longest prompt (default ``12 * ratio``; prompts are drawn from ``[0, max_prompt)``).
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
    max_prompt = max_prompt or 12 * c.ratio
    C = 2 if c.overlap else 1
    norm, freqs, index_norm = sim_post_pool_params(c, gen)
    cache = CompressedKVCache(c, device, batch=batch)
    cache.set_post_pool(norm.to(device), freqs.to(device), None if index_norm is None else index_norm.to(device))
    for t in cache.pool.tensors():  # poison: untouched entries must keep these bytes
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    sim = ref.ReferenceDecodeSim(ratio=c.ratio, head_dim=c.head_dim, rope_dim=c.rope_dim,
                                 index_head_dim=c.index_head_dim if c.has_indexer else None,
                                 overlap=c.overlap, window=c.window_size, norm_weight=norm, rope_freqs=freqs,
                                 index_norm_weight=index_norm, eps=c.norm_eps, entry_numerics=c.entry_numerics,
                                 index_numerics=c.index_numerics)
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
        gcache.set_post_pool(norm.to(device), freqs.to(device), None if index_norm is None else index_norm.to(device))
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
    stored_keys: dict = {}         # rid -> {entry: decoded stored key (float32, CPU)}
    next_rid = 0
    stats = {"steps": 0, "flushes": 0, "prefills": 0, "prefill_entries": 0, "entries_checked": 0,
             "entries_exact": 0, "keys_checked": 0, "keys_exact": 0, "topk_checked": 0, "topk_exact": 0,
             "topk_near_tie_swaps": 0, "topk_ref_keys_exact": 0, "joins": 0, "leaves": 0}
    nope = c.nope_dim

    def check_tails(r, rid, where):
        for st, width, key in ((cache.state, D, "history"), (cache.index_state, Di, "index_history")):
            if st is None:
                continue
            k, z, kb, zb, n = sim.expected_tails(rid, width, key)
            assert torch.equal(st.tail_k[r].cpu(), k), f"{where} row {r}: tail_k"
            assert torch.equal(st.tail_z[r].cpu(), z), f"{where} row {r}: tail_z"
            if kb is not None:
                assert torch.equal(st.tail_kb[r].cpu(), kb), f"{where} row {r}: tail_kb"
                assert torch.equal(st.tail_zb[r].cpu(), zb), f"{where} row {r}: tail_zb"
            assert int(st.tail_len[r]) == n, f"{where} row {r}: tail_len"

    def check_entry(r, rid, e, where, kernel_entry=None):
        """Stored entry e (and key) of request rid in slot r vs the reference."""
        table = cache.block_table.cpu()
        got = ops.gather_entries(cache.pool, cache.block_table, torch.tensor([r], dtype=torch.int32, device=device),
                                 torch.tensor([[e]], dtype=torch.int32, device=device))[0, 0].cpu()
        want = sim.requests[rid]["entries"][e]
        raw = sim.requests[rid]["raw"][e]
        if kernel_entry is not None:
            assert torch.equal(got[nope:], kernel_entry[nope:]), f"{where} row {r}: rope != stored"
        rg, rw = got[nope:].float(), raw[nope:].float()
        assert bool(((rg - rw).abs() <= 2 ** -6 * rw.abs().max() + 2 ** -7 * rw.abs()).all()), \
            f"{where} row {r} entry {e}: rope dims off the reference"
        g, w = got[:nope].float(), want[:nope].float()
        block = ENTRY_SCALE_BLOCK if c.entry_numerics == "official" else nope
        amax = _block_amax(raw[:nope].float(), block)
        tol = 2 ** -3 * w.abs() + 2 ** -7 * amax + 1e-30
        assert bool(((g - w).abs() <= tol).all()), f"{where} row {r} entry {e}: FP8 entry off the reference"
        stats["entries_checked"] += 1
        stats["entries_exact"] += int(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        if c.has_indexer:
            loc = ref.entry_location(table, r, e, c.entries_per_block)
            kd = cache.pool.index_keys[loc].cpu()
            ks = cache.pool.index_key_scale[loc].cpu()
            got_key = ref.dequantize_index_keys(kd, ks, c.index_numerics)
            want_key = sim.requests[rid]["keys"][e]
            kblock = INDEX_SCALE_BLOCK if c.index_numerics == "official" else 16
            kamax = _block_amax(sim.requests[rid]["raw_keys"][e].float(), kblock)
            assert bool(((got_key - want_key).abs() <= 0.34 * kamax + 2 ** -5 * want_key.abs() + 1e-30).all()), \
                f"{where} row {r} entry {e}: indexer key off the reference"
            stats["keys_checked"] += 1
            stats["keys_exact"] += int(torch.equal(got_key, want_key))
            stored_keys[rid][e] = got_key
        return ref.entry_location(table, r, e, c.entries_per_block)

    for step in range(steps):
        # ---- host side: requests leave / join (with a prefill), pages for this step (outside the graph)
        for r in range(batch):
            if rows[r] is not None and life[r] <= 0:
                cache.leave(r)
                if gcache is not None:
                    gcache.leave(r)
                sim.leave(rows[r])
                stored_keys.pop(rows[r])
                rows[r] = None
                stats["leaves"] += 1
            if rows[r] is None and rng.random() < 0.5:
                rid, next_rid = next_rid, next_rid + 1
                # the first prompt: complete windows plus an unfinished one (the official tail handoff)
                T = 2 * c.ratio + 1 if next_rid == 1 else rng.randrange(0, max_prompt)
                pre = {"kv": randn(T, C * D), "score": randn(T, C * D, scale=2.0),
                       "swa_kv": randn(T, D).to(torch.bfloat16)}
                if c.has_indexer:
                    pre.update(index_kv=randn(T, C * Di), index_score=randn(T, C * Di, scale=2.0))
                for cc in (cache, gcache):
                    if cc is None:
                        continue
                    cc.join(r)
                    cc.prepare_forward([r], [0], [T])
                    cc.prefill(r, **pre)
                sim.join(rid)
                sim.prefill(rid, **{k: v.cpu() for k, v in pre.items()})
                stored_keys[rid] = {}
                rows[r] = rid
                life[r] = rng.randrange(1, 6 * c.ratio)
                stats["joins"] += 1
                stats["prefills"] += int(T > 0)
                check_tails(r, rid, f"prefill {T}")
                for pos in range(max(0, T - c.window_size), T):
                    assert torch.equal(cache.swa[r, pos % c.window_size].cpu(), pre["swa_kv"][pos].cpu()), "prefill swa"
                for e in range(T // c.ratio):
                    check_entry(r, rid, e, f"prefill {T}")
                    stats["prefill_entries"] += 1
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
        flush_dev = cache.workspace["flush"].cpu()
        entry_dev = cache.workspace["entry"].cpu().clone()
        for r in live:
            rid = rows[r]
            host = {k: v[r].cpu().clone() for k, v in inputs.items()}  # .cpu() of a CPU tensor is no copy
            flushed = sim.step(rid, host["kv"], host["score"], host["swa_kv"], host.get("index_kv"),
                               host.get("index_score"))
            life[r] -= 1
            assert bool(flush_dev[r]) == flushed, f"step {step} row {r}: flush flag"
            check_tails(r, rid, f"step {step}")
            assert torch.equal(cache.swa[r, positions[r] % c.window_size].cpu(), inputs["swa_kv"][r].cpu())
            if flushed:
                stats["flushes"] += 1
                flushed_locs.add(check_entry(r, rid, positions[r] // c.ratio, f"step {step}", entry_dev[r]))
            if topk is not None:
                n = sim.n_entries(rid)
                got_idx = topk[r].cpu()
                ref_scores = torch.full((c.max_entries,), float("-inf"))
                if n:
                    keys = torch.stack([stored_keys[rid][e] for e in range(n)])
                    ref_scores[:n] = ref.score_keys(host["q"].float(), host["weights"].float(), keys)
                want_idx = ref.select_topk(ref_scores[None], c.index_topk)[0]
                own_idx = sim.topk(rid, host["q"], host["weights"], c.max_entries, c.index_topk)
                stats["topk_ref_keys_exact"] += int(torch.equal(got_idx, own_idx))
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
