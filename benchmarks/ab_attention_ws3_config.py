"""A/B of two ``WS3_CONFIG`` settings of the v3 sparse attention kernel in one run (issue 15).

For each case (kind, batch, context; ``bench_attention.make_case``: random FP8 rows gathered from a paged pool, one
query per request) both configs launch the v3 main kernel (``launch_ws3``) with the op's split layout, and

* ``equal``: whether the two configs write the same bits (the output, or with splits the float32 partials and the
  (m, l) pairs, before the combine) -- configs that only move data between allocations must;
* ``a_us`` / ``b_us``: median CUDA-graph replay of the main kernel alone, L2 cleared before each replay
  (``bench_attention.bench_graph``), the two configs timed alternately, twice each (the median of the two).

Usage (H100): python benchmarks/ab_attention_ws3_config.py --b KV_CHUNKS=8 [--a ""]
       [--cases csa:32:32768,csa:128:32768,hca:128:131072] [--out benchmarks/results/attn_v3/ab]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def _config(text: str) -> dict:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", default="", help="WS3_CONFIG overrides of config A (default: none)")
    ap.add_argument("--b", required=True, help="WS3_CONFIG overrides of config B, e.g. KV_CHUNKS=8")
    ap.add_argument("--cases", default="csa:1:32768,csa:32:32768,csa:64:32768,csa:128:32768,hca:32:131072,"
                                       "hca:64:131072,hca:128:131072")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attn_v3", "ab"))
    args = ap.parse_args()

    import bench_attention as ba
    from megamoe.kernels import sparse_attention as kernels
    from megamoe.kernels import sparse_attention_ws3 as ws3
    from megamoe.ops import errors

    dev = torch.device("cuda")
    cfg_a, cfg_b = _config(args.a), _config(args.b)
    block_n = ws3.WS3_CONFIG["BLOCK_N"]
    rows = []
    for case in args.cases.split(","):
        kind, batch, context = case.split(":")
        c = ba.make_case(int(batch), int(context), kind, dev)
        B, H, D = c["q"].shape
        K = c["entry_idx"].shape[1]
        splits, per = kernels.choose_num_splits(B, H, ba.WINDOW, K, block_n=block_n)
        acc_shape, ml_shape = kernels.workspace_shapes(B, H, D, splits)
        results = {}
        for name, cfg in (("a", cfg_a), ("b", cfg_b)):
            out = torch.full_like(c["q"], float("nan"))
            ws_acc = torch.full(acc_shape, float("nan"), device=dev) if splits > 1 else c["attn_sink"]
            ws_ml = torch.full(ml_shape, float("nan"), device=dev) if splits > 1 else c["attn_sink"]

            def run(cfg=cfg, out=out, ws_acc=ws_acc, ws_ml=ws_ml):
                ws3.launch_ws3(c["q"], c["attn_sink"], D ** -0.5, c["window_kv"], c["window_idx"], c["entries_fp8"],
                               c["entries_scale"], c["entries_rope"], c["block_table"], c["slots"], c["entry_idx"],
                               out, splits=splits, per=per, ws_acc=ws_acc, ws_ml=ws_ml,
                               error_word=errors.error_word(dev), config=cfg)

            run()
            torch.cuda.synchronize()
            results[name] = (run, (ws_acc.clone(), ws_ml.clone()) if splits > 1 else (out.clone(),))
        equal = all(torch.equal(x, y) for x, y in zip(results["a"][1], results["b"][1]))
        finite = bool(torch.isfinite(results["a"][1][0]).all())
        times = {"a": [], "b": []}
        for _ in range(2):
            for name in ("a", "b"):
                times[name].append(ba.bench_graph(results[name][0]) * 1e6)
        a_us, b_us = (sorted(times[n])[0] / 2 + sorted(times[n])[1] / 2 for n in ("a", "b"))
        rows.append(dict(kind=kind, batch=B, context=int(context), entries=K, splits=splits, equal=equal,
                         finite=finite, a_us=a_us, b_us=b_us, a_runs=times["a"], b_runs=times["b"]))
        print(json.dumps(rows[-1]), flush=True)
    lines = [f"A = {cfg_a or 'default'}, B = {cfg_b}", "",
             "| kind | batch | context | splits | same bits | A us | B us | B / A |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['splits']} | {r['equal']} | "
                     f"{r['a_us']:.1f} | {r['b_us']:.1f} | {r['b_us'] / r['a_us']:.3f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(rows=rows, a=cfg_a, b=cfg_b, **meta), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"# v3 attention kernel, config A/B ({meta['device']}, torch {meta['torch']}, "
                f"triton {meta['triton']})\n\n{text}\n")


if __name__ == "__main__":
    main()
