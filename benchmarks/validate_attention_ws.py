"""One-shot GPU validation + timing of the Gluon sparse attention kernels: v2 (``sparse_attention_ws.py``; variants
``ws1`` warp-specialized and ``ws0`` its debugging variant) and v3 (``sparse_attention_ws3.py``, ``ws3``).

Run on the H100: ``python benchmarks/validate_attention_ws.py [--quick] [--timeout 60] [--variants ws1,ws0,ws3]
[--out benchmarks/results/attention_v2]``. Every case runs in its own subprocess and prints one JSON line. The
subprocess first builds its inputs, runs the reference and v1 and compiles v2 without launching it
(``--compile-timeout``, 300 s), then launches v2 under the hard ``--timeout`` (60 s): a hang of the new kernel
is killed and costs at most that, never the session.

1. Correctness (``--case check:...``): v2 (warp-specialized, and ``MEGAMOE_ATTN_WS=0``) vs the float32 reference
   ``megamoe.reference.attention.sparse_mqa_attention`` (run on the GPU) and vs v1, with the bounds of the CUDA
   tests (tests/kernels/test_sparse_attention.py: max |err| <= 1e-2 max |ref|, relative Frobenius <= 4e-3, NaN
   positions equal, queries without rows exact zeros) and the error word: V4-Flash CSA / HCA x batch 1 / 32 /
   128 x context 4k / 32k / 128k, plus a partially filled window, inactive rows (slot -1, no ids), fewer valid
   entries than top-k, and a NaN entry that must stay confined to its request's query.
2. Timing (``--case time:...``): v1, v2 (both variants) and the bf16 gather + matmul PyTorch path of
   benchmarks/bench_attention.py, medians of CUDA-graph replays with the L2 cleared, and % of the byte floor
   (``floor_all`` of bench_attention.py: rows + q / out / index bytes at 3.0 TB/s) and TFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

KINDS = ("csa", "hca")
BATCHES = (1, 32, 128)
CONTEXTS = (4096, 32768, 131072)
EDGE_CASES = ("partial_window", "inactive_rows", "few_entries", "nan_entry")
MAX_TOL, FRO_TOL = 1e-2, 4e-3
READY = "#compiled"
# (name, impl, MEGAMOE_ATTN_WS): v2 warp-specialized, v2's debugging variant, v3 (sparse_attention_ws3.py).
VARIANTS = (("ws1", "ws", "1"), ("ws0", "ws", "0"), ("ws3", "ws3", "1"))


def _variants():
    """The variants this run checks and times (``--variants``, passed to the case subprocesses by env)."""
    names = os.environ.get("MEGAMOE_VALIDATE_VARIANTS", "ws1,ws0,ws3").split(",")
    return [v for v in VARIANTS if v[0] in names]


def _device():
    """CUDA; ``MEGAMOE_VALIDATE_CPU=1`` runs the check cases' plumbing on the CPU (interpreter, "ws" -> v1)."""
    import torch

    return torch.device("cpu" if os.environ.get("MEGAMOE_VALIDATE_CPU") == "1" else "cuda")


def _run_impl(c, impl, variant, out, ws):
    from megamoe.kernels import sparse_attention as kernels

    os.environ["MEGAMOE_ATTN_WS"] = variant
    kw = {k: v for k, v in c.items() if k not in ("q", "attn_sink")}
    return kernels.launch_sparse_mqa_attention(
        c["q"], c["attn_sink"], float(c["q"].shape[-1]) ** -0.5, kw["window_kv"], kw["window_idx"],
        kw["entries_fp8"], kw["entries_scale"], kw["entries_rope"], kw["block_table"], kw["slots"],
        kw["entry_idx"], out, workspace=ws, impl=impl, interpreter=not c["q"].is_cuda)


def _compare(got, want):
    """(ok, message) with the CUDA tests' bounds."""
    import torch

    got, want = got.float(), want.float()
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False, f"NaN positions differ ({int(torch.isnan(got).sum())} vs {int(nan.sum())})"
    zero_rows = (want == 0).all(dim=-1)
    if not torch.equal(got[zero_rows], want[zero_rows]):
        return False, "queries without valid rows are not exact zeros"
    g, w = got[~nan], want[~nan]
    if w.numel() == 0 or float(w.abs().max()) == 0:
        return bool(torch.equal(g, w)), "all zero"
    max_err = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-30)
    fro = float((g - w).norm() / w.norm().clamp_min(1e-30))
    return max_err <= MAX_TOL and fro <= FRO_TOL, f"max {max_err:.2e} fro {fro:.2e}"


def _edge(c, which):
    """Apply an edge case to a bench_attention case in place; returns the queries expected to be NaN (or None)."""
    import torch

    B = c["q"].shape[0]
    dev = c["q"].device
    n = torch.arange(B, device=dev)[:, None]
    if which == "partial_window":
        W = c["window_idx"].shape[1]
        c["window_idx"][torch.arange(W, device=dev)[None, :] >= (n * 37) % (W + 1)] = -1
    elif which == "inactive_rows":
        dead = (torch.arange(B, device=dev) % 3) == 1
        c["slots"][dead] = -1
        c["window_idx"][dead] = -1
        c["entry_idx"][dead] = -1
    elif which == "few_entries":
        K = c["entry_idx"].shape[1]
        c["entry_idx"][torch.arange(K, device=dev)[None, :] >= (n * 61) % (K + 1)] = -1
    elif which == "nan_entry":
        e = int(c["entry_idx"][0, 5])
        page = int(c["block_table"][int(c["slots"][0]), e // c["entries_fp8"].shape[1]])
        c["entries_fp8"].view(torch.uint8)[page, e % c["entries_fp8"].shape[1], 3] = 0x7F     # e4m3 NaN
        expect = torch.zeros(B, dtype=torch.bool)
        expect[0] = True                                   # every request owns its pages: only query 0
        return expect
    return None


def _compile_ws(c):
    """Compile this run's Gluon variants (``_variants``) for the case's shapes without launching them, then tell
    the parent (the hard timeout of the run phase starts after this line; compiling takes longer than running)."""
    import torch
    from megamoe.kernels import sparse_attention as kernels
    from megamoe.kernels import sparse_attention_ws as ws_kernels
    from megamoe.kernels import sparse_attention_ws3 as ws3
    from megamoe.ops import errors

    if c["q"].is_cuda:
        B, H, D = c["q"].shape
        W, K = c["window_idx"].shape[1], c["entry_idx"].shape[1]
        for _, impl, variant in _variants():
            splits, per = kernels.choose_num_splits(B, H, W, K, block_n=kernels.main_block_n(impl))
            acc_shape, ml_shape = kernels.workspace_shapes(B, H, D, splits)
            args = (c["q"], c["attn_sink"], D ** -0.5, c["window_kv"], c["window_idx"], c["entries_fp8"],
                    c["entries_scale"], c["entries_rope"], c["block_table"], c["slots"], c["entry_idx"],
                    torch.empty_like(c["q"]))
            kw = dict(splits=splits, per=per, error_word=errors.error_word(c["q"].device), compile_only=True,
                      ws_acc=torch.empty(acc_shape, device=c["q"].device) if splits > 1 else c["attn_sink"],
                      ws_ml=torch.empty(ml_shape, device=c["q"].device) if splits > 1 else c["attn_sink"])
            try:
                if impl == "ws3":
                    ws3.launch_ws3(*args, **kw)
                else:
                    ws_kernels.launch_ws(*args, warp_spec=variant == "1", **kw)
            except Exception as exc:  # the run phase compiles then (inside the hard timeout)
                print(f"warmup failed: {exc!r}", file=sys.stderr)
        torch.cuda.synchronize()
    print(READY, flush=True)


def check_case(kind, batch, context, edge):
    import torch
    from bench_attention import make_case
    from megamoe.ops import errors
    from megamoe.reference.attention import sparse_mqa_attention as reference

    dev = _device()
    torch.manual_seed(1000 * batch + context // 1024 + (kind == "hca"))
    c = make_case(batch, context, kind, dev)
    expect_nan = _edge(c, edge) if edge else None
    D = c["q"].shape[-1]
    kw = {k: v for k, v in c.items() if k not in ("q", "attn_sink")}
    want = reference(c["q"], c["attn_sink"], D ** -0.5, **kw)
    v1 = _run_impl(c, "v1", "1", torch.empty_like(c["q"]), None)
    _compile_ws(c)
    res = dict(case=f"check:{kind}:{batch}:{context}:{edge or ''}", ok=True)
    for name, impl, variant in _variants():
        errors.clear_errors(dev)
        got = _run_impl(c, impl, variant, torch.empty_like(c["q"]), None)
        ok_ref, msg_ref = _compare(got, want)
        ok_v1, msg_v1 = _compare(got, v1)
        word = errors.peek_errors(dev)
        ok = ok_ref and ok_v1 and word == 0
        if expect_nan is not None:
            nan_q = torch.isnan(got.float()).flatten(1).any(dim=1).cpu()
            ok = ok and torch.equal(nan_q, expect_nan)
        res[name] = dict(ok=ok, vs_ref=msg_ref, vs_v1=msg_v1, error_word=word)
        res["ok"] = res["ok"] and ok
    return res


def time_case(kind, batch, context):
    import torch
    import triton
    from bench_attention import (ENTRY_BYTES, HBM_BYTES_PER_S, ROW_BYTES, WINDOW, bench_graph, make_case,
                                 torch_bf16_path)
    from megamoe.kernels import sparse_attention as kernels
    from megamoe.ops.attention import attention_workspace

    dev = torch.device("cuda")
    c = make_case(batch, context, kind, dev)
    B, H, D = c["q"].shape
    K = c["entry_idx"].shape[1]
    ws = attention_workspace(B, H, D, WINDOW, K, dev)
    outs = {name: torch.empty_like(c["q"]) for name in ("v1", "ws1", "ws0", "ws3", "torch")}
    _compile_ws(c)
    t = {}
    for name, impl, variant in (("v1", "v1", "1"), *_variants()):
        os.environ["MEGAMOE_ATTN_WS"] = variant
        t[name] = bench_graph(lambda: _run_impl(c, impl, variant, outs[name], ws))
    t["torch"] = bench_graph(lambda: torch_bf16_path(c, outs["torch"]))
    row_bytes = B * (WINDOW * ROW_BYTES + K * ENTRY_BYTES)
    all_bytes = row_bytes + B * (2 * H * D * 2 + 4 * (WINDOW + K))
    floor_s = all_bytes / HBM_BYTES_PER_S
    flops = 4 * B * (WINDOW + K) * H * D
    splits, _ = kernels.choose_num_splits(B, H, WINDOW, K)  # v2's (32-row blocks); v3's: splits_ws3
    splits_ws3, _ = kernels.choose_num_splits(B, H, WINDOW, K, block_n=kernels.main_block_n("ws3"))
    rel = {f"rel_fro_{name}_vs_v1": float((outs[name].float() - outs["v1"].float()).norm()
                                          / outs["v1"].float().norm()) for name, _, _ in _variants()}
    return dict(case=f"time:{kind}:{batch}:{context}", ok=True, kind=kind, batch=B, context=context, entries=K,
                splits=splits, splits_ws3=splits_ws3, floor_all_us=floor_s * 1e6, **rel, triton=triton.__version__,
                device=torch.cuda.get_device_name(0),
                **{f"{k}_us": v * 1e6 for k, v in t.items()},
                **{f"{k}_pct_floor": 100 * floor_s / v for k, v in t.items()},
                **{f"{k}_tflops": flops / v / 1e12 for k, v in t.items()})


def run_one(case: str) -> dict:
    parts = case.split(":")
    if parts[0] == "check":
        return check_case(parts[1], int(parts[2]), int(parts[3]), parts[4] or None)
    return time_case(parts[1], int(parts[2]), int(parts[3]))


def spawn(case: str, timeout: float, compile_timeout: float) -> dict:
    """Run one case in a subprocess: up to ``compile_timeout`` s until it has built its inputs, the reference,
    v1 and the v2 binaries (it prints READY), then at most ``timeout`` s for the v2 runs (a hang is killed)."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--case", case], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines, ready_at = [], []

    def read():
        for ln in proc.stdout:
            if ln.startswith(READY):
                ready_at.append(time.time())
            lines.append(ln)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        limit = (ready_at[0] + timeout) if ready_at else (t0 + compile_timeout)
        if time.time() > limit:
            proc.kill()
            proc.wait()
            phase = "run" if ready_at else "set-up / compile"
            return dict(case=case, ok=False, error=f"TIMEOUT in the {phase} phase (hang?), killed")
        time.sleep(0.2)
    reader.join(timeout=5)
    stderr = proc.stderr.read()
    results = [ln for ln in lines if ln.startswith("{")]
    if proc.returncode != 0 or not results:
        return dict(case=case, ok=False, error=f"rc {proc.returncode}: {stderr.strip()[-800:]}")
    res = json.loads(results[-1])
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", help="internal: run one case in this process")
    ap.add_argument("--quick", action="store_true", help="batch 1 / 32, context 4k / 32k only")
    ap.add_argument("--timeout", type=float, default=60.0, help="hard limit of each case's v2 runs (s)")
    ap.add_argument("--compile-timeout", type=float, default=300.0,
                    help="limit of each case's set-up: inputs, reference, v1, compiling v2 without running it (s)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="timing only (correctness validated in an earlier run)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,32,128; --quick 1,32)")
    ap.add_argument("--contexts", help="comma-separated contexts (default 4096,32768,131072; --quick 4k,32k)")
    ap.add_argument("--variants", default="ws1,ws0,ws3", help="comma-separated subset of ws1, ws0, ws3")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attention_v2"))
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_one(args.case)), flush=True)
        return
    os.environ["MEGAMOE_VALIDATE_VARIANTS"] = args.variants  # for the case subprocesses
    batches = BATCHES[:2] if args.quick else BATCHES
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    cases = [f"check:{k}:{b}:{ctx}:" for k in KINDS for b in batches for ctx in contexts]
    cases += [f"check:csa:32:32768:{e}" for e in EDGE_CASES] + ["check:hca:32:131072:partial_window"]
    if args.no_check:
        cases = []
    results = []
    for case in cases:
        res = spawn(case, args.timeout, args.compile_timeout)
        results.append(res)
        print(("PASS " if res["ok"] else "FAIL ") + json.dumps(res), flush=True)
    n_fail = sum(not r["ok"] for r in results)
    print(f"correctness: {len(results) - n_fail}/{len(results)} passed", flush=True)
    timings = []
    if not args.no_timing:
        for k in KINDS:
            for ctx in contexts:
                for b in batches:
                    res = spawn(f"time:{k}:{b}:{ctx}", args.timeout, args.compile_timeout)
                    timings.append(res)
                    print(json.dumps(res), flush=True)
    names = [v[0] for v in _variants()]
    lines = ["| kind | batch | context | splits v2 / v3 | v1 us | " + " | ".join(f"{n} us" for n in names) +
             " | torch bf16 us | floor us | " + " | ".join(f"{n} % floor" for n in names) + " | " +
             " | ".join(f"{n} TFLOP/s" for n in names) + " | best vs v1 | best vs torch |",
             "|" + "---|" * (8 + 3 * len(names))]
    for r in timings:
        if not r.get("ok"):
            lines.append(f"| {r['case']} | {r.get('error', '')} |")
            continue
        best = min(r[f"{n}_us"] for n in names)
        lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['splits']} / {r.get('splits_ws3', '-')} | "
                     f"{r['v1_us']:.1f} | " +
                     " | ".join(f"{r[f'{n}_us']:.1f}" for n in names) +
                     f" | {r['torch_us']:.1f} | {r['floor_all_us']:.2f} | " +
                     " | ".join(f"{r[f'{n}_pct_floor']:.0f}%" for n in names) + " | " +
                     " | ".join(f"{r[f'{n}_tflops']:.0f}" for n in names) +
                     f" | {r['v1_us'] / best:.2f}x | {r['torch_us'] / best:.2f}x |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(checks=results, timings=timings), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("# Sparse attention v2 / v3 (Gluon) validation\n\n"
                f"correctness: {len(results) - n_fail}/{len(results)} passed\n\n" + "\n".join(lines) + "\n")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
