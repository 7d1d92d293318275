"""Layer benchmark: NVFP4 MoE block (routed + shared expert) vs the bf16 PyTorch layer and the HBM roofline.

For each token count: the NVFP4 layer (``megamoe.layers.Nvfp4MoE``, w4a16) eager and
CUDA-graph replay; the bf16 layer on the *dequantized* weights (same router and
dispatch, ``torch._grouped_mm`` for the experts, torch ops for SwiGLU/combine),
graph replay; the HBM roofline of the NVFP4 layer (bytes of touched expert
weights + shared expert + gate + activations at 3.0 TB/s) and the bf16 tensor-core
roofline (749 TFLOP/s). Times are triton.testing.do_bench medians; inputs rotate
over 4 random batches.

Usage: python benchmarks/bench_moe.py [--configs v4-flash,guide] [--tokens 1,8,64,512,4096]
       [--modes w4a16,w4a8] [--out-dir benchmarks/results] [--tag moe_v1]
(issue 13: ``--configs v4-flash,v4-pro --tokens 4096,8192,16384 --modes w4a16,w4a8`` times both modes.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

HBM_BYTES_PER_S = 3.0e12
BF16_FLOPS = 749e12


def _bf16_layer(layer, w13=None, w2=None):
    """The bf16 PyTorch layer on dequantized weights; returns forward(x). ``w13`` (E, 2I, H) / ``w2`` (E, H, I)
    bf16: weights dequantized by the caller (e.g. in expert chunks, bench_moe_skew.py), else dequantized here."""
    from megamoe.ops import moe as moe_ops
    from megamoe.ops.quantize import dequantize
    from megamoe.reference.moe import swiglu

    c = layer.config
    w13 = (dequantize(layer.w13, torch.bfloat16) if w13 is None else w13).transpose(1, 2)  # (E, H, 2I), K-major
    w2 = (dequantize(layer.w2, torch.bfloat16) if w2 is None else w2).transpose(1, 2)  # (E, I, H)
    sw13 = dequantize(layer.shared.w13, torch.bfloat16) if layer.shared is not None else None
    sw2 = dequantize(layer.shared.w2, torch.bfloat16) if layer.shared is not None else None
    i = c.intermediate_size

    def forward(x):
        topk_weights, topk_ids = layer.route(x)
        d = moe_ops.dispatch(topk_ids, c.num_experts)
        xs = x.index_select(0, d["row_index"])
        h = torch._grouped_mm(xs, w13, offs=d["expert_offsets"])
        act = swiglu(h[:, :i], h[:, i:], c.swiglu_limit)
        y = torch._grouped_mm(act, w2, offs=d["expert_offsets"])
        shared = None
        if sw13 is not None:
            hs = x @ sw13.t()
            shared = swiglu(hs[:, : sw13.shape[0] // 2], hs[:, sw13.shape[0] // 2 :], c.swiglu_limit) @ sw2.t()
        return moe_ops.combine(y, d["inv_perm"], topk_weights, shared)

    return forward


def _graph(fn, static_in):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static_in)
    return g, out


def bench_config(config, token_counts, progress, seed=0, fuse_shared_max_tokens=None, modes=("w4a16",),
                 shared_overlap=None):
    import triton.testing

    from megamoe.layers.moe import DISPATCH_KERNEL_MAX_PAIRS, Nvfp4MoE
    from megamoe.ops import moe as moe_ops

    max_tokens = max(token_counts)
    layer = Nvfp4MoE.random(config, seed=seed, max_num_tokens=max_tokens, device="cuda",
                            fuse_shared_max_tokens=fuse_shared_max_tokens, shared_overlap=shared_overlap)
    try:  # V4-Pro's dequantized experts (~51 GB) do not fit beside the NVFP4 layer on an 80 GB GPU
        bf16_forward = _bf16_layer(layer)
    except torch.OutOfMemoryError:
        bf16_forward = None
        torch.cuda.empty_cache()
        print(f"{config.name}: the bf16 layer does not fit on this GPU; its columns are left empty")
    rows = []
    c = config
    for t, mode in [(t, m) for t in token_counts for m in modes]:
        layer.set_mode(mode)
        xs = [torch.randn(t, c.hidden_size, device="cuda").to(torch.bfloat16) for _ in range(4)]
        counter = [0]

        def next_x():
            counter[0] = (counter[0] + 1) % len(xs)
            return xs[counter[0]]

        eager_ms = triton.testing.do_bench(lambda: layer.forward(next_x()), warmup=10, rep=50)
        static_in = xs[0].clone()
        g, g_out = _graph(layer.forward, static_in)
        g.replay()
        eager_out = layer.forward(static_in).clone()
        g.replay()
        graph_equal = bool(torch.equal(g_out, eager_out))

        def replay():
            static_in.copy_(next_x())
            g.replay()

        graph_ms = triton.testing.do_bench(replay, warmup=10, rep=50)
        static_b = xs[0].clone()
        gb = None
        bf16_ms = rel_vs_bf16 = float("nan")
        if bf16_forward is not None:
            gb, gb_out = _graph(bf16_forward, static_b)

            def replay_b():
                static_b.copy_(next_x())
                gb.replay()

            bf16_ms = triton.testing.do_bench(replay_b, warmup=10, rep=50)
            gb.replay()
            ours = layer.forward(static_b)
            rel_vs_bf16 = ((ours.float() - gb_out.float()).norm() / gb_out.float().norm()).item()
        # the non-GEMM part of the layer alone (router, dispatch, combine), graph replay
        def overhead(x):
            w, i = layer.route(x)
            backend = "triton" if i.numel() <= DISPATCH_KERNEL_MAX_PAIRS else "torch"  # as the layer's "auto"
            d = moe_ops.dispatch(i, c.num_experts, backend=backend)
            return moe_ops.combine(layer._expert_out, d["inv_perm"], w)

        static_o = xs[0].clone()
        go, _ = _graph(overhead, static_o)
        overhead_ms = triton.testing.do_bench(go.replay, warmup=10, rep=50)
        _, ids = layer.route(static_b)
        touched = int(torch.unique(ids).numel())
        act_bytes = 2 * t * c.hidden_size * 2 + 2 * t * c.top_k * (c.intermediate_size + c.hidden_size) * 2
        nbytes = layer.weight_bytes(touched) + act_bytes
        flops = 2.0 * t * (c.num_experts * c.hidden_size + 3 * c.hidden_size * (
            c.top_k * c.intermediate_size + c.shared_intermediate_size))
        hbm_us = nbytes / HBM_BYTES_PER_S * 1e6
        tc_us = flops / BF16_FLOPS * 1e6
        roof_us = max(hbm_us, tc_us)
        rows.append({
            "config": c.name, "mode": mode, "tokens": t, "experts_touched": touched,
            "nvfp4_eager_us": eager_ms * 1e3, "nvfp4_graph_us": graph_ms * 1e3, "bf16_graph_us": bf16_ms * 1e3,
            "route_dispatch_combine_graph_us": overhead_ms * 1e3,
            "shared_expert_fused": layer.fuses_shared(t),
            "shared_overlap": layer.overlaps_shared(t),
            "hbm_roofline_us": hbm_us, "tc_roofline_us": tc_us,
            "pct_of_roofline": 100.0 * roof_us / (graph_ms * 1e3),
            "speedup_vs_bf16": bf16_ms / graph_ms,
            "nvfp4_GBps": nbytes / (graph_ms * 1e-3) / 1e9, "nvfp4_TFLOPs": flops / (graph_ms * 1e-3) / 1e12,
            "rel_err_vs_bf16_layer": rel_vs_bf16, "graph_equals_eager": graph_equal,
        })
        del g, gb, go
        progress.update(1)
    del layer, bf16_forward
    torch.cuda.empty_cache()
    return rows


def _num(value: float, spec: str, suffix: str = "") -> str:
    """A table cell: the formatted number, or "-" for NaN (a column that was not measured)."""
    return "-" if value != value else f"{value:{spec}}{suffix}"


def write_results(rows, out_dir, tag, command):
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "command": command,
        "rooflines": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS},
    }
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# NVFP4 MoE layer benchmark (routed experts + shared expert)", "",
        "- shared expert fused into the routed grouped GEMMs at token counts: "
        f"{sorted({r['tokens'] for r in rows if r['shared_expert_fused']})}"
        + ("; shared expert on a side stream beside the router (shared_overlap)"
           if any(r.get("shared_overlap") for r in rows) else ""),
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{command}`",
        "- times: do_bench medians in microseconds, 4 rotating input batches; bf16 = same router/dispatch, "
        "dequantized weights, `torch._grouped_mm`, graph replay; roofline = max(HBM 3.0 TB/s on touched weights + "
        "activations, bf16 749 TFLOP/s)", "",
        "| config | mode | tokens | experts touched | nvfp4 eager us | nvfp4 graph us | of which route+dispatch+combine us "
        "| bf16 graph us | HBM roofline us "
        "| % of roofline | speedup vs bf16 | GB/s | TFLOP/s | rel err vs bf16 layer | graph == eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r.get('mode', 'w4a16')} | {r['tokens']} | {r['experts_touched']} | {r['nvfp4_eager_us']:.1f} | "
            f"{r['nvfp4_graph_us']:.1f} | {r['route_dispatch_combine_graph_us']:.1f} | {_num(r['bf16_graph_us'], '.1f')} | "
            f"{r['hbm_roofline_us']:.1f} | {r['pct_of_roofline']:.0f}% | {_num(r['speedup_vs_bf16'], '.2f', 'x')} | "
            f"{r['nvfp4_GBps']:.0f} | {r['nvfp4_TFLOPs']:.1f} | {_num(r['rel_err_vs_bf16_layer'], '.1e')} | "
            f"{r['graph_equals_eager']} |")
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in sorted({r["config"] for r in rows}):
            rs = [r for r in rows if r["config"] == name]
            tk = [r["tokens"] for r in rs]
            ax.plot(tk, [r["nvfp4_graph_us"] for r in rs], "o-", label=f"{name} nvfp4 (graph)")
            ax.plot(tk, [r["bf16_graph_us"] for r in rs], "s--", label=f"{name} bf16 _grouped_mm")
            ax.plot(tk, [max(r["hbm_roofline_us"], r["tc_roofline_us"]) for r in rs], ":", label=f"{name} roofline")
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        ax.set_xlabel("tokens"), ax.set_ylabel("us per layer call"), ax.legend(fontsize=7)
        ax.set_title(f"NVFP4 MoE layer, {meta['device']}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{tag}.png"), dpi=110)
    except ImportError:
        pass
    return os.path.join(out_dir, f"{tag}.md")


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # graph_timing
    from graph_timing import add_flush_argument, flush_mode

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v4-flash,guide")
    p.add_argument("--tokens", default="1,8,64,512,4096")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="moe_v1")
    p.add_argument("--fuse-shared-max-tokens", type=int, default=None,
                   help="run the shared expert inside the routed GEMMs up to this many tokens (default: the layer's)")
    p.add_argument("--shared-overlap", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="Nvfp4MoE(shared_overlap=): the shared expert apart, on a side stream beside the routed "
                        "experts; auto (default: the layer's rule), on (alone: the flag), off")
    p.add_argument("--modes", default="w4a16",
                   help="comma-separated activation modes timed per token count, e.g. w4a16,w4a8 (issue 13)")
    add_flush_argument(p)
    args = p.parse_args(argv)
    with flush_mode(args.flush):
        return run(args, command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])))


def _modes(args) -> tuple:
    """The --modes list (``python -m megamoe bench`` passes no such option: w4a16)."""
    return tuple(str(getattr(args, "modes", None) or "w4a16").split(","))


def run(args, command: str) -> int:
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (the layer benchmark compares GPU kernels)")
        return 2
    from megamoe.models.config import PRESETS

    configs = [PRESETS[name] for name in args.configs.split(",")]
    token_counts = [int(t) for t in args.tokens.split(",")]
    try:
        from tqdm import tqdm

        progress = tqdm(total=len(configs) * len(token_counts) * len(_modes(args)), desc="moe layer bench")
    except ImportError:
        class _Plain:
            def update(self, n):
                print(".", end="", flush=True)

            def close(self):
                print()

        progress = _Plain()
    rows = []
    for config in configs:
        rows += bench_config(config, token_counts, progress,
                             fuse_shared_max_tokens=getattr(args, "fuse_shared_max_tokens", None), modes=_modes(args),
                             shared_overlap={"on": True, "off": False}.get(getattr(args, "shared_overlap", "auto")))
        path = write_results(rows, args.out_dir, args.tag, command)  # after each config: partial results survive
    progress.close()
    print(open(path).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
