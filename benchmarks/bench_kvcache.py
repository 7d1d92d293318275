"""Benchmark: compressed-cache flush-write and indexer scoring + top-k (DeepSeek-V4 dims) on one GPU.

For batch 1..128 and context up to 128k tokens (CSA, m = 4: up to 32768 compressed entries per request):
* ``flush_write`` (CSA, every row flushing: FP8 entry + bf16 RoPE + FP4 indexer key) and HCA;
* ``indexer_scores`` (FP4 keys decoded in-kernel, 64 heads x 128 dims, bf16 tensor cores);
* ``select_topk`` (stable sort, top 512) and scores + top-k together;
* the bf16 PyTorch path for the same scoring: dense bf16 keys, einsum + relu + weighted head sum + topk;
* the whole CSA decode step (SWA append, two compressor steps, post-pool RMSNorm/RoPE/Hadamard,
  flush-write, scoring, top-k) replayed from one CUDA graph.
Storage numerics: ``--entry-numerics official|per_entry`` and ``--index-numerics official|nvfp4`` (default:
the official ones: FP8 + power-of-two scale per 64 dims, E2M1 + E8M0 scale per 32 dims).
Bytes moved are the minimum each kernel must touch; ``hbm_frac`` compares bytes / time with 3.0 TB/s.
Timings are ``triton.testing.do_bench`` medians; the scoring rotates between two pools' worth of
requests (slot sets) so the L2 cache does not hold the keys between calls.

Usage: python benchmarks/bench_kvcache.py [--quick] [--index-numerics nvfp4] [--out benchmarks/results/kvcache_v4]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache, DecodeBatch, ops  # noqa: E402
from megamoe.reference.v4_numerics import rope_frequencies  # noqa: E402

HBM_BYTES_PER_S = 3.0e12


def bench(fn, reps=50):
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e-3  # seconds


def fill_pool(cache: CompressedKVCache, slots: int, entries: int):
    """Pages for ``slots`` requests of ``entries`` entries; random keys with valid scales."""
    c = cache.config
    for s in range(slots):
        cache.join(s)
    cache.prepare_forward(list(range(slots)), [0] * slots, [entries * c.ratio] * slots)
    p = cache.pool
    p.index_keys.random_(0, 256)
    if p.index_numerics == "official":
        p.index_key_scale.random_(120, 131)                      # E8M0 2**-7 .. 2**3
    else:
        p.index_key_scale.view(torch.uint8).random_(0x30, 0x40)  # E4M3 0.5 .. 1.9 (no NaN 0x7F)


def entry_bytes(pool) -> int:
    """Stored bytes of one entry (every pool tensor)."""
    return sum(t[0, 0].numel() * t.element_size() for t in pool.tensors())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kvcache_v4")
    ap.add_argument("--entry-numerics", default="official", choices=["official", "per_entry"])
    ap.add_argument("--index-numerics", default="official", choices=["official", "nvfp4"])
    args = ap.parse_args()
    numerics = dict(entry_numerics=args.entry_numerics, index_numerics=args.index_numerics)
    dev = torch.device("cuda")
    batches = [1, 8, 32, 128] if not args.quick else [1, 32]
    contexts = [8192, 32768, 131072] if not args.quick else [8192, 131072]
    H, Di, topk = 64, 128, 512
    rows = []
    max_b, max_ctx = max(batches), max(contexts)
    # two request sets of max_b slots each, rotated to defeat L2
    cfg = CompressedCacheConfig(kind="csa", max_slots=2 * max_b, max_context=max_ctx, entries_per_block=64, **numerics)
    cache = CompressedKVCache(cfg, dev)
    fill_pool(cache, 2 * max_b, cfg.max_entries)
    torch.cuda.synchronize()
    print(f"pool: {sum(t.numel() * t.element_size() for t in cache.pool.tensors()) / 2**30:.2f} GiB", flush=True)

    for B in batches:
        # ---- flush-write (CSA and HCA), all rows flushing
        entry = torch.randn((B, 512), device=dev).to(torch.bfloat16)
        key = torch.randn((B, Di), device=dev).to(torch.bfloat16)
        flush = torch.ones(B, dtype=torch.bool, device=dev)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        positions = (torch.randint(0, cfg.max_entries, (B,), device=dev) * 4 + 3).to(torch.int32)
        t_flush = bench(lambda: ops.flush_write(cache.pool, cache.block_table, entry, key, flush, slots, positions,
                                                ratio=4))
        flush_bytes = B * (512 * 2 + Di * 2 + entry_bytes(cache.pool) + 4 * 3)
        rows.append(dict(op="flush_write_csa", batch=B, context=None, us=t_flush * 1e6, bytes=flush_bytes,
                         hbm_frac=flush_bytes / t_flush / HBM_BYTES_PER_S))
        print(rows[-1], flush=True)

        for ctx in contexts:
            T = ctx // 4
            n_entries = torch.full((B,), T, dtype=torch.int32, device=dev)
            q = torch.randn((B, H, Di), device=dev).to(torch.bfloat16)
            w = torch.randn((B, H), device=dev)
            scores = torch.empty((B, T), device=dev)
            slot_sets = [torch.arange(B, dtype=torch.int32, device=dev),
                         torch.arange(max_b, max_b + B, dtype=torch.int32, device=dev)]
            it = [0]

            def score_only():
                it[0] ^= 1
                ops.indexer_scores(cache.pool, cache.block_table, q, w, slot_sets[it[0]], n_entries, scores)

            def score_topk():
                score_only()
                return ops.select_topk(scores, topk)

            t_score = bench(score_only)
            t_topk = bench(lambda: ops.select_topk(scores, topk))
            t_both = bench(score_topk)
            key_bytes = B * T * (Di // 2 + cfg.index_scale_cols)
            score_bytes = key_bytes + B * T * 4 + B * H * Di * 2
            flops = 2 * B * T * H * Di
            # bf16 PyTorch path: dense bf16 keys (B, T, Di)
            dense = torch.randn((B, T, Di), device=dev).to(torch.bfloat16)

            def torch_path():
                logits = torch.einsum("bhd,btd->bth", q, dense)
                s = (torch.relu(logits.float()) * w[:, None, :]).sum(-1)
                return s.topk(min(topk, T), dim=-1).indices

            t_torch = bench(torch_path)
            del dense
            rows.append(dict(op="indexer_scores", batch=B, context=ctx, entries=T, us=t_score * 1e6,
                             bytes=score_bytes, hbm_frac=score_bytes / t_score / HBM_BYTES_PER_S,
                             tflops=flops / t_score / 1e12))
            rows.append(dict(op="select_topk", batch=B, context=ctx, entries=T, us=t_topk * 1e6))
            rows.append(dict(op="scores+topk", batch=B, context=ctx, entries=T, us=t_both * 1e6,
                             bytes=score_bytes, hbm_frac=score_bytes / t_both / HBM_BYTES_PER_S))
            rows.append(dict(op="torch_bf16_scores+topk", batch=B, context=ctx, entries=T, us=t_torch * 1e6,
                             bytes=B * T * Di * 2, speedup_of_ours=t_torch / t_both))
            for r in rows[-4:]:
                print(r, flush=True)

    # HCA flush-write
    hcfg = CompressedCacheConfig(kind="hca", max_slots=max_b, max_context=max_ctx, entries_per_block=64, **numerics)
    hcache = CompressedKVCache(hcfg, dev)
    for s in range(max_b):
        hcache.join(s)
    hcache.prepare_forward(list(range(max_b)), [0] * max_b, [max_ctx] * max_b)
    for B in batches:
        entry = torch.randn((B, 512), device=dev).to(torch.bfloat16)
        flush = torch.ones(B, dtype=torch.bool, device=dev)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        positions = torch.full((B,), 127, dtype=torch.int32, device=dev)
        t = bench(lambda: ops.flush_write(hcache.pool, hcache.block_table, entry, None, flush, slots, positions,
                                          ratio=128))
        b = B * (512 * 2 + entry_bytes(hcache.pool) + 12)
        rows.append(dict(op="flush_write_hca", batch=B, context=None, us=t * 1e6, bytes=b,
                         hbm_frac=b / t / HBM_BYTES_PER_S))
        print(rows[-1], flush=True)
    del hcache

    # whole CSA decode step from one CUDA graph (batch B, every request at a flush step, context 32k)
    for B in batches:
        scfg = CompressedCacheConfig(kind="csa", max_slots=B, max_context=32768, entries_per_block=64, **numerics)
        sc = CompressedKVCache(scfg, dev, batch=B)
        freqs = rope_frequencies(64, scfg.max_context, base=160000.0, original_seq_len=65536, factor=16)
        sc.set_post_pool(torch.ones(512, device=dev), freqs.to(dev), torch.ones(Di, device=dev))
        fill_pool(sc, B, scfg.max_entries - 1)
        db = DecodeBatch.allocate(B, dev)
        db.set(list(range(B)), [scfg.max_context - 5] * B, [True] * B)
        sc.prepare_forward(list(range(B)), [scfg.max_context - 5] * B, [scfg.max_context - 4] * B)
        inp = dict(kv=torch.randn((B, 1024), device=dev), score=torch.randn((B, 1024), device=dev),
                   swa_kv=torch.randn((B, 512), device=dev).to(torch.bfloat16),
                   index_kv=torch.randn((B, 256), device=dev), index_score=torch.randn((B, 256), device=dev),
                   q=torch.randn((B, H, Di), device=dev).to(torch.bfloat16), weights=torch.randn((B, H), device=dev))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sc.decode_step(db, **inp)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sc.decode_step(db, **inp)
        t = bench(g.replay)
        T = scfg.max_entries
        b = B * T * (Di // 2 + scfg.index_scale_cols) + B * T * 4
        rows.append(dict(op="csa_decode_step_graph", batch=B, context=32768, entries=T, us=t * 1e6, bytes=b,
                         hbm_frac=b / t / HBM_BYTES_PER_S))
        print(rows[-1], flush=True)
        del sc, g

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python benchmarks/bench_kvcache.py" + (" --quick" if args.quick else "")
                + f" --entry-numerics {args.entry_numerics} --index-numerics {args.index_numerics}",
                hbm_bytes_per_s=HBM_BYTES_PER_S)
    out_dir = os.environ.get("OUT")
    paths = [args.out] + ([os.path.join(out_dir, os.path.basename(args.out))] if out_dir else [])
    for base in paths:
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
        with open(base + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(f"# kvcache benchmark\n\n{json.dumps(meta)}\n\n")
            f.write("| op | batch | context | entries/req | us | bytes | HBM frac | extra |\n|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                extra = {k: round(v, 3) for k, v in r.items() if k in ("tflops", "speedup_of_ours")}
                f.write(f"| {r['op']} | {r['batch']} | {r.get('context') or ''} | {r.get('entries', '')} | "
                        f"{r['us']:.1f} | {r.get('bytes', '')} | {r.get('hbm_frac', 0):.3f} | {extra or ''} |\n")


if __name__ == "__main__":
    main()
