"""Issue 11: the mma.sync decode GEMMs with x already in the paired order (``X_PAIRED``) against today's x.

The decode kernel builds each MMA B operand (x) with two byte permutes per MMA (32 of the ~452 instructions of a
K step of the one-wave config, offline SASS); with x stored in the paired order
(``megamoe.format.mma_order.to_paired_order``) it moves whole registers instead. This probe measures what that is
worth before anything produces the paired x for free:

- op level: the two grouped GEMM calls of one ``Nvfp4MoE`` forward (recorded from the layer, so the same bands,
  configs and routing), each timed as its own CUDA graph, today's x against a paired copy made outside the graph
  (the kernel's gain alone, an upper bound); outputs compared bit for bit;
- ``--ncu``: one eager launch of each GEMM per variant after a warm-up, for
  ``ncu --kernel-name regex:mma_decode --launch-skip 4 --launch-count 4 --section WarpStateStats ...``.

Run (H100): ``python benchmarks/probe_x_paired.py [--configs v4-flash,v4-pro] [--tokens 1,8] [--flush read]
[--rounds 3] [--out DIR] [--tag T]`` -> DIR/probe_x_paired[_T].md
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _record_gemms(layer, x):
    """The (args, kwargs) of the layer's two nvfp4_grouped_mm calls in one forward (inputs cloned at call time)."""
    from megamoe.ops import gemm as gemm_ops

    calls, orig = [], gemm_ops.nvfp4_grouped_mm

    def spy(*args, **kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) and k != "out" else v) for k, v in kwargs.items()}
        kwargs["out"] = torch.empty_like(kwargs["out"]) if kwargs.get("out") is not None else None
        calls.append((args, kwargs))
        return orig(*args, **kwargs)

    gemm_ops.nvfp4_grouped_mm = spy
    try:
        layer(x)
        torch.cuda.synchronize()
    finally:
        gemm_ops.nvfp4_grouped_mm = orig
    return calls


@contextlib.contextmanager
def _paired_launches(paired_x):
    """Every mma decode launch whose x is a key of ``paired_x`` (by data_ptr) gets the paired copy + x_paired."""
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma

    orig = mma.launch_nvfp4_mma_decode

    def launch(x, *args, **kwargs):
        xp = paired_x.get(x.data_ptr())
        if xp is None:
            return orig(x, *args, **kwargs)
        return orig(xp, *args, x_paired=True, **kwargs)

    mma.launch_nvfp4_mma_decode = launch
    try:
        yield
    finally:
        mma.launch_nvfp4_mma_decode = orig


def _variants(call):
    """{name: (fn, out)}: today's launch and the paired one, each writing its own output buffer."""
    from megamoe.format.mma_order import to_paired_order
    from megamoe.ops import gemm as gemm_ops

    args, kwargs = call
    x = args[0]
    xp = to_paired_order(x)
    out_base = kwargs["out"]
    out_paired = torch.empty_like(out_base)
    kw_paired = dict(kwargs, out=out_paired)

    def base():
        gemm_ops.nvfp4_grouped_mm(*args, **kwargs)

    def paired():
        with _paired_launches({x.data_ptr(): xp}):
            gemm_ops.nvfp4_grouped_mm(*args, **kw_paired)

    return {"x": (base, out_base), "paired x": (paired, out_paired)}


def main(argv=None) -> int:
    from graph_timing import add_flush_argument, capture_graph, flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="1,8")
    add_flush_argument(ap, default="read")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ncu", action="store_true", help="eager launches only (for ncu), V4-Flash 1 token")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_x_paired.py needs a CUDA GPU")
        return 0
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS

    dev = torch.device("cuda")
    if args.ncu:
        c = PRESETS["v4-flash"]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=1)
        x = torch.randn(1, c.hidden_size, device=dev).bfloat16()
        variants = [_variants(call) for call in _record_gemms(layer, x)]
        for _ in range(2):  # warm-up, then the profiled round: gate_up x, gate_up paired, down x, down paired
            for v in variants:
                for fn, _ in v.values():
                    fn()
            torch.cuda.synchronize()
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.configs.split(","):
        c = PRESETS[name]
        layer = Nvfp4MoE.random(c, seed=0, device=dev, max_num_tokens=max(tokens))
        for t in tokens:
            x = torch.randn(t, c.hidden_size, device=dev,
                            generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            for gemm, call in zip(("gate_up", "down"), _record_gemms(layer, x)):
                variants = _variants(call)
                graphs = {v: capture_graph(fn) for v, (fn, _) in variants.items()}
                same = torch.equal(variants["x"][1], variants["paired x"][1])
                times = {v: [] for v in variants}
                with flush_mode(args.flush):
                    for _ in range(args.rounds):
                        for v, g in graphs.items():
                            times[v].append(triton.testing.do_bench(g.replay, warmup=20, rep=150,
                                                                    return_mode="median") * 1e3)
                base = statistics.median(times["x"])
                paired = statistics.median(times["paired x"])
                rows.append((name, t, gemm, base, paired, base / paired, same, times))
                print(f"{name} T={t} {gemm}: x {base:.1f} us, paired {paired:.1f} us ({base / paired:.3f}x), "
                      f"same bits {same}, rounds {[[round(v, 1) for v in ts] for ts in times.values()]}", flush=True)
                del graphs
        del layer
        torch.cuda.empty_cache()
    tag = f"_{args.tag}" if args.tag else ""
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# mma decode GEMMs: x in the paired order vs today's x ({torch.cuda.get_device_name()})", "",
             f"- {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; torch "
             f"{torch.__version__}; triton {triton.__version__}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- each GEMM call of one `Nvfp4MoE` forward (recorded; default settings) as its own CUDA graph; "
             f"do_bench median, L2 cleared by a {args.flush} flush; median of {args.rounds} interleaved rounds. "
             "The paired copy of x is made outside the graph (the kernel's gain alone).", "",
             "| config | tokens | GEMM | x us | paired x us | speed-up | same bits |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.3f}x | {'yes' if r[6] else 'NO'} |"
              for r in rows]
    with open(os.path.join(args.out, f"probe_x_paired{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
