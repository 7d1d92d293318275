"""Benchmark: V4 indexer scores + exact top-k on one GPU (see benchmarks/NOTES_topk.md, v5).

Default and ``--quick``: the issue's points, batch 1, 8, 32, 128 x context 4k, 32k, 128k (CSA, m = 4:
T = context / 4 entries) x k 512, 1024 (``--quick``: shorter timing, 3 replays of >= 1 ms); per shape
* ``ours``: megamoe.kvcache.ops.indexer_topk (FP4 indexer scores + our top-k, the plan of
  megamoe/kernels/topk.py ``PLAN``; at small batch the scoring kernel also writes the tile maxima);
* ``topk``: megamoe.ops.topk.topk_indices alone on the same float32 scores;
* ``bf16``: the bf16 PyTorch path (dense bf16 keys, einsum + relu + weighted head sum + torch.topk);
and the table: speedup = bf16 / ours (v5: plus, on the split path, the rows per finish mode and n_U from the
workspace header after a top-k call on the timed scores), "meets" = speedup >= 2 and (batch 1) ours <= 20 us.
The indices of ``ours`` are checked against the reference (select_topk of the same scores) once per shape.

``--sweep``: top-k alone at batch 1 and 8 for each path / knob of the plan (sort path and its warps, row
path, split programs per row, one-sort finish ``fin``, first-histogram ``bins``, warps), coordinate by
coordinate from the current plan; prints every timing, the best per shape (with the split diagnostics:
entries in the threshold bucket, which finish ran) and a ``PLAN["gpu"]`` replacement to paste.

Timing: CUDA graphs of n back-to-back calls (n so that a replay is >= ~2 ms, at most 200), median over 5
replays / n. The scoring rotates between two request sets so L2 does not hold the keys across calls.

Compiles: the kernels take their shapes as unspecialised runtime arguments (v4), so a kernel configuration
(path, K_P2 class, bins, warps; the scoring kernel's tiles per program) compiles once for every shape that
shares it. The grid first calls every shape once (compiling each new configuration, checking the indices
against the reference, printing the seconds each first call took and the configuration key), grouped by
key, then times; ``--budget`` seconds (default 540) stop the timing early with a partial table, and the
JSON is rewritten after every shape, so one 600 s device call always leaves results.

Usage: python benchmarks/bench_topk.py [--quick] [--sweep] [--budget S] [--out benchmarks/results/topk_v4]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.kernels import topk as kt  # noqa: E402
from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache, ops  # noqa: E402
from megamoe.ops.topk import topk_indices  # noqa: E402
from megamoe.reference.kvcache import select_topk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kvcache import fill_pool  # noqa: E402  (random keys with valid scales for either numerics)

H, DI = 64, 128


def graph_us(fn, min_ms: float = 2.0, replays: int = 5) -> float:
    """Median time of one call of ``fn`` in microseconds, from CUDA-graph replays of n calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    g.replay()
    e1.record()
    torch.cuda.synchronize()
    one = max(e0.elapsed_time(e1) * 1e3, 1.0)
    n = max(1, min(200, int(min_ms * 1e3 / one)))
    del g
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    times = []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / n)
    del g
    return statistics.median(times)


class Setup:
    """One pool for two request sets of max_b slots at the longest context, reused by every shape."""

    def __init__(self, max_b: int, max_ctx: int, dev):
        self.dev, self.max_b = dev, max_b
        cfg = CompressedCacheConfig(kind="csa", max_slots=2 * max_b, max_context=max_ctx, entries_per_block=64)
        self.cache = CompressedKVCache(cfg, dev)
        fill_pool(self.cache, 2 * max_b, cfg.max_entries)
        torch.cuda.synchronize()

    def shape(self, B: int, T: int):
        dev = self.dev
        n_entries = torch.full((B,), T, dtype=torch.int32, device=dev)
        q = torch.randn((B, H, DI), device=dev).to(torch.bfloat16)
        w = torch.randn((B, H), device=dev)
        scores = torch.empty((B, T), device=dev)
        slot_sets = [torch.arange(B, dtype=torch.int32, device=dev),
                     torch.arange(self.max_b, self.max_b + B, dtype=torch.int32, device=dev)]
        ops.indexer_scores(self.cache.pool, self.cache.block_table, q, w, slot_sets[0], n_entries, scores)
        return n_entries, q, w, scores, slot_sets


def config_key(B: int, T: int, k: int, dev) -> tuple:
    """What decides which compiled kernels a shape uses (shapes sharing a key share every compile)."""
    from megamoe.kernels.kvcache import indexer as ki

    nsm = kt._num_sms(dev)
    plan = kt.plan_for(B, T, k, num_sms=nsm)
    K = min(k, T)
    k_p2 = max(16, triton.next_power_of_2(K))
    if plan.path == "sort":
        topk = ("sort", max(16, triton.next_power_of_2(T)), plan.warps)
    else:
        topk = (plan.path, k_p2, plan.bins, plan.warps, plan.fin > 0)
    return topk + (("tiles", ki.tiles_per_program(B, T, num_sms=nsm), plan.path == "split"),)


def split_diagnostics(plan, scores, k, out, ws):
    """v5: per-row finish of the split path from the workspace header after one more top-k call on the timed
    scores: rows per mode (0 rank finish by S4, 1 whole row by S2's merging program, 2 D steps in S3), n_U
    (entries S4 ranked) and entries in b* (min / median / max over rows). None for the sort / row paths."""
    if plan.path != "split":
        return None
    ws[:, 6] = -1
    topk_indices(scores, k, out=out, workspace=ws)
    hdr = ws[:, :8].cpu()
    mode, n_u, cnt = hdr[:, 3], hdr[:, 7], hdr[:, 5]

    def mmm(x):
        x = sorted(x.tolist())
        return [x[0], x[len(x) // 2], x[-1]]

    return dict(modes=[int((mode == m).sum()) for m in range(3)], n_u=mmm(n_u), b_count=mmm(cnt),
                finish=sorted(set(hdr[:, 6].tolist())))


def run_grid(args, dev, t_start: float, save):
    batches, contexts, ks = [1, 8, 32, 128], [4096, 32768, 131072], [512, 1024]
    min_ms, replays = (1.0, 3) if args.quick else (2.0, 5)
    st = Setup(max(batches), max(contexts), dev)
    pool, table = st.cache.pool, st.cache.block_table
    shapes = [(B, ctx, k) for B in batches for ctx in contexts for k in ks]
    shapes.sort(key=lambda s: (repr(config_key(s[0], s[1] // 4, s[2], dev)), s))  # one compile per key
    print(f"setup {time.time() - t_start:.0f} s; {len(shapes)} shapes, "
          f"{len({config_key(B, c // 4, k, dev) for B, c, k in shapes})} kernel configurations", flush=True)
    rows, compiled = [], {}
    for B, ctx, k in shapes:  # pass 1: compile each configuration once, check every shape
        T, K = ctx // 4, min(k, ctx // 4)
        n_entries, q, w, scores, slot_sets = st.shape(B, T)
        out = torch.empty((B, K), dtype=torch.int32, device=dev)
        ws = torch.zeros((B, max(1, kt.workspace_entries(T, k, batch=B))), dtype=torch.int32, device=dev)
        t0 = time.time()
        ops.indexer_topk(pool, table, q, w, slot_sets[0], n_entries, scores, k, out=out, workspace=ws)
        topk_indices(scores, k, out=out, workspace=ws)
        torch.cuda.synchronize()
        key = config_key(B, T, k, dev)
        first = key not in compiled
        compiled.setdefault(key, round(time.time() - t0, 1))
        ops.indexer_topk(pool, table, q, w, slot_sets[0], n_entries, scores, k, out=out, workspace=ws)
        assert torch.equal(out, select_topk(scores, k)), (B, T, k)
        print(f"checked B={B} T={T} k={k} key={key}" + (f" compiled in {compiled[key]} s" if first else ""),
              flush=True)
        del n_entries, q, w, scores, slot_sets, out, ws
    print(f"compiles + checks done at {time.time() - t_start:.0f} s", flush=True)
    for B, ctx, k in sorted(shapes):  # pass 2: timing (batch-major)
        if time.time() - t_start > args.budget:
            print(f"budget {args.budget:.0f} s reached: B={B} ctx={ctx} k={k} and later shapes not timed", flush=True)
            break
        T, K = ctx // 4, min(k, ctx // 4)
        n_entries, q, w, scores, slot_sets = st.shape(B, T)
        dense = torch.randn((B, T, DI), device=dev, dtype=torch.bfloat16)
        out = torch.empty((B, K), dtype=torch.int32, device=dev)
        ws = torch.zeros((B, max(1, kt.workspace_entries(T, k, batch=B))), dtype=torch.int32, device=dev)

        def ours():  # two request sets (L2 rotation), scores + top-k each
            for sl in slot_sets:
                ops.indexer_topk(pool, table, q, w, sl, n_entries, scores, k, out=out, workspace=ws)

        def bf16():
            logits = torch.einsum("bhd,btd->bth", q, dense)
            s = (torch.relu(logits.float()) * w[:, None, :]).sum(-1)
            return s.topk(K, dim=-1).indices

        t_ours = graph_us(ours, min_ms, replays) / 2
        t_topk = graph_us(lambda: topk_indices(scores, k, out=out, workspace=ws), min_ms, replays)
        t_bf16 = graph_us(bf16, min_ms, replays)
        plan = kt.plan_for(B, T, k, num_sms=kt._num_sms(dev))
        diag = split_diagnostics(plan, scores, k, out, ws)
        sp = t_bf16 / t_ours
        meets = sp >= 2.0 and (B != 1 or t_ours <= 20.0)
        rows.append(dict(batch=B, context=ctx, entries=T, k=k, ours_us=t_ours, topk_us=t_topk,
                         bf16_us=t_bf16, speedup=sp, meets=meets, plan=plan._asdict(),
                         first_call_s=compiled.get(config_key(B, T, k, dev)), diag=diag))
        print(rows[-1], flush=True)
        save(rows, compiled)
        dense = None  # free before the next shape
    return rows, compiled


def sweep(args, dev):
    """Top-k alone per knob, coordinate by coordinate from the current plan (batch 1 and 8)."""
    t0 = time.time()
    batches = [int(v) for v in args.sweep_batches.split(",")]
    contexts = [int(v) for v in args.sweep_contexts.split(",")]
    ks = [512, 1024]
    st = Setup(max(batches), max(contexts), dev)
    nsm = kt._num_sms(dev)
    best_rows, lines = [], []
    for B in batches:
        for ctx in contexts:
            T = ctx // 4
            _, _, _, scores, _ = st.shape(B, T)
            for k in ks:
                K = min(k, T)
                out = torch.empty((B, K), dtype=torch.int32, device=dev)
                want = select_topk(scores, k)
                # no programs / batch: room for any plan's workspace (K == T has none)
                ws = torch.zeros((B, kt.workspace_entries(T, k)), dtype=torch.int32, device=dev)
                results = {}

                def time_plan(plan: kt.Plan):
                    key = tuple(plan)
                    if key in results or time.time() - t0 > args.budget:
                        return results.get(key, (float("inf"), None))
                    kw = dict(path=plan.path, fin=plan.fin, bins=plan.bins, num_warps=plan.warps or None)
                    if plan.path == "split":
                        kw["programs"] = plan.programs
                    if ws.shape[1] > 6:
                        ws[:, 6] = -1
                    kt.launch_topk(scores, out, ws, **kw)
                    ok = torch.equal(out, want)
                    diag = ws[0, :8].tolist() if plan.path == "split" else None
                    us = graph_us(lambda: kt.launch_topk(scores, out, ws, **kw)) if ok else float("inf")
                    results[key] = (us, diag)
                    lines.append(f"B={B} T={T} k={k} {plan} -> {us:.1f} us"
                                 + ("" if ok else " WRONG") + (f" diag[b*,need,mode,ref,count,finish,n_U]="
                                                               f"{diag[1:8]}" if diag else ""))
                    print(lines[-1], flush=True)
                    return results[key]

                base = kt.plan_for(B, T, k, num_sms=nsm)
                cands = [base, kt.Plan("row", fin=2), kt.Plan("row", fin=0)]
                if T <= 8192:
                    cands += [kt.Plan("sort", warps=wp) for wp in ((4, 8, 16) if T <= 2048 else (16,))]
                for P in (8, 16, 32, 64, 128):
                    if 2 <= P <= min(T // 256, 2 * nsm // B):
                        cands.append(kt.Plan("split", programs=P))
                for c in cands:
                    time_plan(c)
                if not results:  # out of budget
                    continue
                best = min(results, key=lambda x: results[x][0])
                bp = kt.Plan(*best)
                if bp.path in ("split", "row"):  # refine the one-sort finish, the bins, the warps
                    for fin in (0, 1, 2):
                        time_plan(bp._replace(fin=fin))
                    bp = kt.Plan(*min(results, key=lambda x: results[x][0]))
                    time_plan(bp._replace(bins=128 if bp.bins == 256 else 256))
                    bp = kt.Plan(*min(results, key=lambda x: results[x][0]))
                    for wp in (8, 16):
                        time_plan(bp._replace(warps=wp))
                    bp = kt.Plan(*min(results, key=lambda x: results[x][0]))
                best_rows.append(dict(batch=B, entries=T, k=k, best=bp._asdict(), us=results[tuple(bp)][0],
                                      plan_now=base._asdict(),
                                      plan_now_us=results.get(tuple(base), (float("inf"),))[0]))
                print("BEST", best_rows[-1], flush=True)
    print(f"\nsweep: {time.time() - t0:.0f} s\n")
    print("| batch | entries | k | plan now | us | best | us |\n|---|---|---|---|---|---|---|")
    for r in best_rows:
        print(f"| {r['batch']} | {r['entries']} | {r['k']} | {r['plan_now']} | {r['plan_now_us']:.1f} | "
              f"{r['best']} | {r['us']:.1f} |")
    print("\n# paste into megamoe/kernels/topk.py PLAN['gpu'] (rows for batch <= 8; keep the catch-all rows):")
    for r in best_rows:
        b = r["best"]
        print(f"        ({r['batch']}, {r['entries']}, ({r['k']},), Plan({b['path']!r}, programs={b['programs']}, "
              f"warps={b['warps']}, fin={b['fin']}, bins={b['bins']})),")
    return dict(best=best_rows, lines=lines)


def _diag_cells(d) -> str:
    if not d:
        return "- | - | -"
    return f"{'/'.join(map(str, d['modes']))} | {'/'.join(map(str, d['n_u']))} | {d['b_count'][2]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-batches", default="1,8", help="--sweep: comma-separated batch sizes")
    ap.add_argument("--sweep-contexts", default="4096,32768,131072", help="--sweep: comma-separated contexts")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds before timing stops (default: 540 for the grid, 170 for the sweep)")
    ap.add_argument("--out", default="benchmarks/results/topk_v5")
    args = ap.parse_args()
    if args.budget is None:
        args.budget = 170.0 if args.sweep else 540.0
    dev = torch.device("cuda")
    t0 = time.time()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command=" ".join(["python benchmarks/bench_topk.py"] + sys.argv[1:]),
                timing="CUDA graph of n calls, median of 5 (--quick: 3) replays / n")
    out_dir = os.environ.get("OUT")
    base = args.out + ("_sweep" if args.sweep else "")
    paths = [base] + ([os.path.join(out_dir, os.path.basename(base))] if out_dir else [])
    for p in paths:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    if args.sweep:
        res = sweep(args, dev)
        for p in paths:
            with open(p + ".json", "w") as f:
                json.dump(dict(meta=meta, **res), f, indent=1)
        return

    def save(rows, compiled):
        meta["seconds"] = round(time.time() - t0)
        for p in paths:
            with open(p + ".json", "w") as f:
                json.dump(dict(meta=meta, rows=rows, first_call_s={repr(k): v for k, v in compiled.items()}), f,
                          indent=1)
            with open(p + ".md", "w") as f:
                f.write(f"# indexer scores + top-k (v5)\n\n{json.dumps(meta)}\n\n")
                f.write("| batch | context | entries | k | ours us | top-k alone us | bf16 path us | speedup | meets | "
                        "plan | rows by mode 0/1/2 | n_U min/med/max | b* entries max |\n"
                        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
                for r in rows:
                    pl = r["plan"]
                    f.write(f"| {r['batch']} | {r['context']} | {r['entries']} | {r['k']} | {r['ours_us']:.1f} | "
                            f"{r['topk_us']:.1f} | {r['bf16_us']:.1f} | {r['speedup']:.2f}x | "
                            f"{'yes' if r['meets'] else 'NO'} | {pl['path']} P={pl['programs']} fin={pl['fin']} "
                            f"bins={pl['bins']} w={pl['warps']} | " + _diag_cells(r.get("diag")) + " |\n")

    rows, compiled = run_grid(args, dev, t0, save)
    save(rows, compiled)
    print(open(paths[0] + ".md").read())


if __name__ == "__main__":
    main()
