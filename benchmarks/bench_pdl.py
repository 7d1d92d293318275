"""PDL (programmatic dependent launch, ``megamoe/kernels/pdl.py``) off vs on for the decode path (issues 11, 15).

``MEGAMOE_PDL`` is read at import, so each setting runs in its own child process (as benchmarks/bench_guard.py);
the two settings alternate for ``--rounds`` rounds so that clock drift hits both alike. Per child, CUDA-graph
replay, ``triton.testing.do_bench`` median (L2 flushed before each replay, as do_bench does), per row:

* ``moe``: the MoE layer of each of ``--configs`` (default V4-Flash; ``Nvfp4MoE.random`` seed 0, as bench_guard /
  bench_moe) at ``--tokens`` (default 1, 8); inputs rotate over 4 random batches;
* ``topk``: ``launch_topk`` at batch 1, 128k entries, k 512 / 1024 (the split path, 3-4 launches) and batch 8,
  32k, k 1024;
* ``attn``: V4-Flash CSA sparse attention (``benchmarks/bench_attention.make_case``, 32k context, top-k 512) at
  batch 1 and 32 (the default impl, main kernel + split combine);
* ``tiny``: one whole decode step (+ greedy sampling) of the 4-layer tiny V4 model, batch 2 (every decode-path
  kernel family; sizes are tiny, so it is launch-bound: the upper bound of what PDL can give per launch).

Outputs of the two settings are compared by digest (bit for bit). The decode GEMMs (nvfp4_mma_decode) follow
the same switch; nvfp4_splitk has no PDL yet.

Usage: python benchmarks/bench_pdl.py [--parts moe,topk,attn,tiny] [--configs v4-flash] [--tokens 1,8]
       [--rounds 2] [--out PATH]
Writes PATH.md and PATH.json (date, device, versions, command). About 2 minutes on an H100.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PARTS = ("moe", "topk", "attn", "tiny")


def _digest(*ts) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _time_graph(fn, warmup=25, rep=200) -> dict:
    """Capture fn() once (after a warm-up call on a side stream) and time the replays."""
    import torch
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    graph.replay()
    torch.cuda.synchronize()
    return dict(median_us=ms[0] * 1e3, p20_us=ms[1] * 1e3, p80_us=ms[2] * 1e3, digest=_digest(*outs))


def child(parts: list[str], tokens: list[int], configs: list[str]) -> dict:
    import torch
    import triton.testing

    from megamoe.kernels import pdl
    from megamoe.ops import errors

    rows = {}
    for name in configs if "moe" in parts else []:
        from megamoe.layers.moe import Nvfp4MoE
        from megamoe.models.config import PRESETS

        config = PRESETS[name]
        layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=max(tokens), device="cuda")
        for t in tokens:
            gen = torch.Generator(device="cuda").manual_seed(1234 + t)
            xs = [torch.randn(t, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(4)]
            run = layer.capture(t)
            counter = [0]

            def replay(run=run, xs=xs, counter=counter):
                counter[0] = (counter[0] + 1) % len(xs)
                run(xs[counter[0]])

            ms = triton.testing.do_bench(replay, warmup=25, rep=300, quantiles=[0.5, 0.2, 0.8])
            y = run(xs[0]).clone()
            rows[f"moe {name} {t} tok"] = dict(median_us=ms[0] * 1e3, p20_us=ms[1] * 1e3, p80_us=ms[2] * 1e3,
                                               digest=_digest(y))
            del run, replay
        del layer
        torch.cuda.empty_cache()
    if "topk" in parts:
        from megamoe.kernels.topk import launch_topk, resolve_plan, workspace_entries

        for B, T, k in ((1, 131072, 512), (1, 131072, 1024), (8, 32768, 1024)):
            gen = torch.Generator(device="cuda").manual_seed(7 + B + k)
            scores = torch.randn(B, T, device="cuda", generator=gen)
            out = torch.empty(B, k, dtype=torch.int32, device="cuda")
            plan = resolve_plan(B, T, k, scores.device)
            scratch = torch.zeros(B, workspace_entries(T, k), dtype=torch.int32, device="cuda")
            rows[f"topk B={B} T={T} k={k} ({plan.path})"] = _time_graph(lambda: [launch_topk(scores, out, scratch)])
    if "attn" in parts:
        from bench_attention import make_case

        from megamoe.kernels import sparse_attention as kernels
        from megamoe.ops.attention import attention_workspace

        for batch in (1, 32):
            torch.manual_seed(11 + batch)
            c = make_case(batch, 32768, "csa", torch.device("cuda"))
            B, H, D = c["q"].shape
            K = c["entry_idx"].shape[1]
            ws = attention_workspace(B, H, D, c["window_idx"].shape[1], K, torch.device("cuda"))
            out = torch.empty_like(c["q"])

            def attn(c=c, out=out, ws=ws):
                kernels.launch_sparse_mqa_attention(
                    c["q"], c["attn_sink"], float(D) ** -0.5, c["window_kv"], c["window_idx"], c["entries_fp8"],
                    c["entries_scale"], c["entries_rope"], c["block_table"], c["slots"], c["entry_idx"], out,
                    workspace=ws)
                return [out]

            splits, _ = kernels.choose_num_splits(B, H, c["window_idx"].shape[1], K)
            rows[f"attn csa B={batch} 32k ({kernels.default_impl()}, {splits} splits)"] = _time_graph(attn)
            del c, ws, out
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    errors.check_errors("cuda")  # valid inputs: nothing was flagged
    if "tiny" in parts:
        from megamoe.models.config import V4_TINY_MODEL
        from megamoe.models.model import V4Model
        from megamoe.models.v4_weights import random_state_dict

        dev = torch.device("cuda")
        m = V4Model(V4_TINY_MODEL, max_batch=2, max_prefill_tokens=16, max_context=256, device=dev)
        m.load_weights(random_state_dict(V4_TINY_MODEL, seed=7, device=dev))
        prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
        first = [int(torch.argmax(m.prefill(s, torch.tensor(p, device=dev)))) for s, p in enumerate(prompts)]
        step = m.capture_decode(2)
        step.tokens.copy_(torch.tensor(first))
        seen = [step([0, 1]).clone() for _ in range(4)]
        torch.cuda.synchronize()
        errors.check_errors("cuda")
        # timing only: replays of one step (same positions; the compressed caches' tails see repeated writes, so
        # the error word is not checked after this)
        m.prepare_decode(step.batch, [0, 1])
        ms = triton.testing.do_bench(step.graph.replay, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
        rows["tiny V4 decode step, batch 2, 4 layers"] = dict(median_us=ms[0] * 1e3, p20_us=ms[1] * 1e3,
                                                             p80_us=ms[2] * 1e3, digest=_digest(*seen))
    return {"pdl": pdl.PDL_ENABLED, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--configs", default="v4-flash", help="MoE presets (megamoe.models.config.PRESETS)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", os.path.join(ROOT, "benchmarks", "results")),
                                                 "pdl_v2"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    if any(s not in PARTS for s in parts):
        print(f"bench_pdl: --parts: expected a subset of {PARTS}, got {parts}")
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        print("RESULT " + json.dumps(child(parts, tokens, args.configs.split(","))), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench_pdl: needs a CUDA GPU")
        return 2
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))
    runs = {"off": [], "on": []}
    for r in range(args.rounds):
        for setting in ("off", "on"):
            # off: no kernel with PDL (the per-kernel defaults of megamoe.kernels.pdl emptied too)
            env = dict(os.environ, MEGAMOE_PDL="1" if setting == "on" else "0", MEGAMOE_PDL_PROLOGUE="",
                       MEGAMOE_PDL_LAUNCH="")
            env.pop("TRITON_INTERPRET", None)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--parts", args.parts,
                                   "--tokens", args.tokens, "--configs", args.configs], env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
                print(f"bench_pdl: the PDL-{setting} process failed (rc {proc.returncode})")
                return 1
            result = json.loads(lines[-1][len("RESULT "):])
            if result["pdl"] != (setting == "on"):
                print(f"bench_pdl: MEGAMOE_PDL did not take effect in the PDL-{setting} process")
                return 1
            runs[setting].append(result["rows"])
            print(f"round {r + 1} PDL {setting}: " + "; ".join(
                f"{name} {row['median_us']:.1f} us" for name, row in result["rows"].items()), flush=True)

    rows = []
    for name in runs["off"][0]:
        off = [run[name]["median_us"] for run in runs["off"]]
        on = [run[name]["median_us"] for run in runs["on"]]
        digests = {run[name]["digest"] for setting in runs.values() for run in setting}
        off_us, on_us = statistics.median(off), statistics.median(on)
        rows.append(dict(row=name, off_us=off_us, on_us=on_us, saved_us=off_us - on_us, speedup=off_us / on_us,
                         off_runs_us=off, on_runs_us=on, outputs_identical=len(digests) == 1))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "command": command, "rounds": args.rounds}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# PDL off vs on, decode path (CUDA-graph replay)", "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{command}`",
        f"- each setting in its own process (MEGAMOE_PDL=0/1), do_bench median per process, median over "
        f"{args.rounds} alternating processes per setting", "",
        "| row | PDL off us | PDL on us | saved us | speed-up | runs off (us) | runs on (us) | outputs identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['row']} | {r['off_us']:.2f} | {r['on_us']:.2f} | {r['saved_us']:+.2f} | "
                     f"{r['speedup']:.3f}x | {', '.join(f'{v:.1f}' for v in r['off_runs_us'])} | "
                     f"{', '.join(f'{v:.1f}' for v in r['on_runs_us'])} | {r['outputs_identical']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["outputs_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
