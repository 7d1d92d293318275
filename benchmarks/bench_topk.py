"""Benchmark: exact top-k of the V4 indexer scores on one GPU (see benchmarks/NOTES_topk.md).

For batch 1, 8, 32, 128 x context 4k, 32k, 128k (CSA, m = 4: T = context / 4 entries) x k 512, 1024:
* ``topk``: megamoe.ops.topk.topk_indices (bucket-select kernels, v2: rows split over several programs at
  small batch) on float32 scores; ``topk_v1``: the v1 one-program-per-row kernel (``programs=1``);
* ``torch_topk_f32``: ``torch.topk(scores, k).indices`` (no tie / -inf guarantees; a speed reference);
* ``select_topk``: the current reference path (int64 keys + torch.topk);
* ``scores+topk``: megamoe.kvcache.ops.indexer_scores on a pool of random NVFP4 keys + our top-k;
* ``torch_bf16_scores+topk``: the bf16 PyTorch path of bench_kvcache (dense bf16 keys, einsum + relu +
  weighted head sum + torch topk).
Every timing is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``); the scoring
rotates between two request sets so L2 does not hold the keys across replays.

Usage: python benchmarks/bench_topk.py [--quick] [--out benchmarks/results/topk_v1]
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

from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache, ops  # noqa: E402
from megamoe.ops.topk import topk_indices  # noqa: E402
from megamoe.reference.kvcache import select_topk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kvcache import fill_pool  # noqa: E402  (random keys with valid scales for either numerics)


def graph_median_us(fn, reps=100):
    """Median of CUDA-graph replays of ``fn`` in microseconds (one call per graph)."""
    fn()  # compile / warm outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/topk_v2")
    args = ap.parse_args()
    dev = torch.device("cuda")
    batches = [1, 8, 32, 128] if not args.quick else [1, 32]
    contexts = [4096, 32768, 131072] if not args.quick else [4096, 131072]
    ks = [512, 1024]
    H, Di = 64, 128
    max_b, max_ctx = max(batches), max(contexts)
    cfg = CompressedCacheConfig(kind="csa", max_slots=2 * max_b, max_context=max_ctx, entries_per_block=64)
    cache = CompressedKVCache(cfg, dev)
    fill_pool(cache, 2 * max_b, cfg.max_entries)
    torch.cuda.synchronize()
    rows = []
    for B in batches:
        for ctx in contexts:
            T = ctx // 4
            n_entries = torch.full((B,), T, dtype=torch.int32, device=dev)
            q = torch.randn((B, H, Di), device=dev).to(torch.bfloat16)
            w = torch.randn((B, H), device=dev)
            scores = torch.empty((B, T), device=dev)
            slot_sets = [torch.arange(B, dtype=torch.int32, device=dev),
                         torch.arange(max_b, max_b + B, dtype=torch.int32, device=dev)]
            ops.indexer_scores(cache.pool, cache.block_table, q, w, slot_sets[0], n_entries, scores)
            dense = torch.randn((B, T, Di), device=dev).to(torch.bfloat16)
            for k in ks:
                K = min(k, T)
                out = torch.empty((B, K), dtype=torch.int32, device=dev)
                assert torch.equal(topk_indices(scores, k, out=out), select_topk(scores, k)), (B, T, k)
                t_ours = graph_median_us(lambda: topk_indices(scores, k, out=out))
                from megamoe.kernels.topk import launch_topk, workspace_entries
                ws1 = torch.zeros((B, max(1, workspace_entries(T, k, programs=1))), dtype=torch.int32, device=dev)
                out1 = torch.empty_like(out)
                launch_topk(scores, out1, ws1, programs=1)
                assert torch.equal(out1, out), (B, T, k)
                t_v1 = graph_median_us(lambda: launch_topk(scores, out1, ws1, programs=1))
                t_torch = graph_median_us(lambda: torch.topk(scores, K, dim=1).indices)
                t_ref = graph_median_us(lambda: select_topk(scores, k))

                def both():  # scores of two request sets (L2 rotation) + top-k each
                    for sl in slot_sets:
                        ops.indexer_scores(cache.pool, cache.block_table, q, w, sl, n_entries, scores)
                        topk_indices(scores, k, out=out)

                def score_only():
                    for sl in slot_sets:
                        ops.indexer_scores(cache.pool, cache.block_table, q, w, sl, n_entries, scores)

                def torch_path():
                    logits = torch.einsum("bhd,btd->bth", q, dense)
                    s = (torch.relu(logits.float()) * w[:, None, :]).sum(-1)
                    return s.topk(K, dim=-1).indices

                t_both = graph_median_us(both) / 2
                t_score = graph_median_us(score_only) / 2
                t_bf16 = graph_median_us(torch_path)
                base = dict(batch=B, context=ctx, entries=T, k=k)
                rows += [dict(op="topk", us=t_ours, **base),
                         dict(op="topk_v1", us=t_v1, **base),
                         dict(op="torch_topk_f32", us=t_torch, **base),
                         dict(op="select_topk", us=t_ref, **base),
                         dict(op="indexer_scores", us=t_score, **base),
                         dict(op="scores+topk", us=t_both, **base),
                         dict(op="torch_bf16_scores+topk", us=t_bf16, speedup_of_ours=t_bf16 / t_both, **base)]
                for r in rows[-6:]:
                    print(r, flush=True)
            del dense

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python benchmarks/bench_topk.py" + (" --quick" if args.quick else ""),
                timing="median of CUDA-graph replays (triton.testing.do_bench_cudagraph)")
    out_dir = os.environ.get("OUT")
    paths = [args.out] + ([os.path.join(out_dir, os.path.basename(args.out))] if out_dir else [])
    for base in paths:
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
        with open(base + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(f"# top-k benchmark\n\n{json.dumps(meta)}\n\n")
            f.write("| op | batch | context | entries/req | k | us | bf16 path / ours |\n"
                    "|---|---|---|---|---|---|---|\n")
            for r in rows:
                sp = f"{r['speedup_of_ours']:.2f}" if "speedup_of_ours" in r else ""
                f.write(f"| {r['op']} | {r['batch']} | {r['context']} | {r['entries']} | {r['k']} | "
                        f"{r['us']:.1f} | {sp} |\n")


if __name__ == "__main__":
    main()
