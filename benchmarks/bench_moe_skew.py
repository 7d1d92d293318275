"""MoE layer under skewed routing (issue 10): NVFP4 layer vs the bf16 layer and the routing's own floor.

For V4-Flash and V4-Pro (random weights, ``Nvfp4MoE.random``, built in expert chunks) at 8, 64, 512 and 4096
tokens and three routings, every forward in CUDA-graph replay:

* ``uniform``: each token's top-k experts drawn uniformly (distinct);
* ``zipf``: top-k distinct experts drawn with probability ~ 1 / rank**1.2 (ranks over a fixed random
  permutation of the experts);
* ``all-on-k``: every token routed to the same k experts.

The routing is forced by replacing the layer's ``route`` with a copy of fixed (weights, ids) tensors, which the
NVFP4 layer and the bf16 layer (same dispatch, dequantized weights, ``torch._grouped_mm``, torch SwiGLU and
combine; the ``_bf16_layer`` of bench_moe.py, built here expert chunk by expert chunk so V4-Pro fits an 80 GB
GPU) both read. Floor = max(bytes of the touched experts' FP4 weights and scales + shared expert + gate +
activations / 3.0 TB/s, FLOPs / 749 TFLOP/s). "meets": not slower than bf16, and within 2x of the floor.

Usage: python benchmarks/bench_moe_skew.py [--configs v4-flash,v4-pro] [--tokens 8,64,512,4096]
       [--routings uniform,zipf,all-on-k] [--tag moe_skew_v1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe import BF16_FLOPS, HBM_BYTES_PER_S, _bf16_layer, _graph  # noqa: E402

ROUTINGS = ("uniform", "zipf", "all-on-k")


def routing(kind: str, tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    """(weights (T, k) fp32, ids (T, k) int32) on the CPU; ids distinct per token."""
    perm = torch.randperm(num_experts, generator=gen)
    if kind == "uniform":
        ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=1).indices
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        ids = perm[torch.multinomial(p.expand(tokens, num_experts), top_k, replacement=False, generator=gen)]
    elif kind == "all-on-k":
        ids = perm[:top_k].expand(tokens, top_k)
    else:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {kind!r}")
    w = torch.rand(tokens, top_k, generator=gen) + 0.1
    return (w / w.sum(1, keepdim=True)).float(), ids.to(torch.int32).contiguous()


def _dequantize_chunked(t, chunk: int = 16):
    """(E, N, K) NVFP4 -> bf16, a few experts at a time (no float32 copy of the whole tensor)."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.ops.quantize import dequantize

    e = t.shape[0]
    out = torch.empty(tuple(t.shape), dtype=torch.bfloat16, device=t.data.device)
    gs = t.global_scale
    for a in range(0, e, chunk):
        b = min(e, a + chunk)
        g = gs[a:b] if gs.dim() == 3 and gs.shape[0] == e else gs
        dequantize(NVFP4Tensor(t.data[a:b], t.block_scale[a:b], g, (b - a,) + tuple(t.shape[1:])),
                   torch.bfloat16, out=out[a:b])
    return out


def _force_routing(layer, weights, ids):
    """Make the layer use fixed (weights, ids): the layer's forward routes with ``megamoe.ops.moe.route_dispatch``
    (one launch at decode sizes), so that op is replaced, while this benchmark runs, by a device copy of the fixed
    tensors into the layer's routing buffers + ``dispatch`` on them (graph-capturable). ``layer.route`` is
    replaced too (the reference path). Before 2026-11-26 only ``layer.route`` was replaced, which forward no longer
    calls: every routing ran the router's own (near-uniform) choice (rel err 0.69 vs the forced bf16 layer). Until
    2026-11-28 the stand-in also ignored ``x_paired_out`` (the paired copy of x that the route launch writes for the
    expert GEMMs at 1-8 tokens since 2026-11-27): those layers read a stale buffer (rel err ~1 vs bf16 at 8 tokens in
    results/gpu_check_v37/h_moe_skew.md; the same work, so the times stand)."""
    from megamoe.ops import moe as moe_ops

    original = getattr(moe_ops, "_unforced_route_dispatch", moe_ops.route_dispatch)
    moe_ops._unforced_route_dispatch = original

    def route_dispatch(hidden_states, gate_weight, correction_bias, *, top_k, slots=None, out=None, buffers=None,
                       num_groups=None, dispatch_backend="auto", x_paired_out=None, **unused):
        t, k = hidden_states.shape[0], ids.shape[1]
        if x_paired_out is not None:  # the route launch's other output: x in the paired order (gate_up's input)
            from megamoe.format.mma_order import to_paired_order

            to_paired_order(hidden_states, out=x_paired_out[:t])
        slots = top_k if slots is None else slots
        num_groups = gate_weight.shape[0] if num_groups is None else num_groups
        if out is None:
            w_out, i_out = weights[:t], ids[:t]
        else:  # the first k columns, as the router writes them (column k of a fused layer is the shared expert)
            out[0][:t, :k].copy_(weights[:t])
            out[1][:t, :k].copy_(ids[:t])
            w_out, i_out = out[0][:t, :k], out[1][:t, :k]
        pair_ids = out[1][:t, :slots] if slots > top_k else i_out
        backend = dispatch_backend if dispatch_backend != "auto" else "torch"
        return w_out, i_out, moe_ops.dispatch(pair_ids, num_groups, buffers=buffers, backend=backend)

    moe_ops.route_dispatch = route_dispatch

    def route(hidden_states, out=None, token_ids=None):
        t = hidden_states.shape[0]
        return weights[:t], ids[:t]

    layer.route = route


def _unforce_routing():
    from megamoe.ops import moe as moe_ops

    if hasattr(moe_ops, "_unforced_route_dispatch"):
        moe_ops.route_dispatch = moe_ops._unforced_route_dispatch
        del moe_ops._unforced_route_dispatch


def bench_config(config, token_counts, routings, rep_ms, seed=0):
    import triton.testing

    from megamoe.layers.moe import Nvfp4MoE

    c = config
    max_tokens = max(token_counts)
    t0 = time.time()
    layer = Nvfp4MoE.random(c, seed=seed, max_num_tokens=max_tokens, device="cuda")
    # forward reads the kernel layouts only: drop the checkpoint-layout copies as their bf16 copies are made
    # (V4-Pro: 14 GB of NVFP4 kernel layouts + 51 GB of bf16 weights at the end, 70 GB at the peak)
    layer._expert_bytes = (layer.w13.nbytes() + layer.w2.nbytes()) // c.num_experts
    w13 = _dequantize_chunked(layer.w13)
    layer.w13 = None
    torch.cuda.empty_cache()
    w2 = _dequantize_chunked(layer.w2)
    layer.w2 = None
    torch.cuda.empty_cache()
    bf16 = _bf16_layer(layer, w13, w2)
    print(f"{c.name}: built in {time.time() - t0:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for kind in routings:
        for t in token_counts:
            weights, ids = (v.cuda() for v in routing(kind, t, c.num_experts, c.top_k, gen))
            _force_routing(layer, weights, ids)
            xs = [torch.randn(t, c.hidden_size, device="cuda").to(torch.bfloat16) for _ in range(2)]
            static = xs[0].clone()
            g, g_out = _graph(layer.forward, static)
            gb, gb_out = _graph(bf16, static)
            g.replay(), gb.replay()
            torch.cuda.synchronize()
            eager = layer.forward(static).clone()
            g.replay()
            graph_equal = bool(torch.equal(g_out, eager))
            rel = ((g_out.float() - gb_out.float()).norm() / gb_out.float().norm()).item()
            ours_us = triton.testing.do_bench(g.replay, warmup=5, rep=rep_ms) * 1e3
            bf16_us = triton.testing.do_bench(gb.replay, warmup=5, rep=rep_ms) * 1e3
            touched = int(torch.unique(ids).numel())
            act = 2 * t * c.hidden_size * 2 + 2 * t * c.top_k * (c.intermediate_size + c.hidden_size) * 2
            nbytes = layer.weight_bytes(touched) + act
            flops = 2.0 * t * (c.num_experts * c.hidden_size + 3 * c.hidden_size * (
                c.top_k * c.intermediate_size + c.shared_intermediate_size))
            floor_us = max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6
            rows.append({
                "config": c.name, "routing": kind, "tokens": t, "experts_touched": touched,
                "max_rows_per_expert": int(torch.bincount(ids.flatten().long()).max()),
                "ours_us": ours_us, "bf16_us": bf16_us, "floor_us": floor_us,
                "ours_over_floor": ours_us / floor_us, "speedup_vs_bf16": bf16_us / ours_us,
                "meets": bool(ours_us <= bf16_us and (t < 8 or ours_us <= 2 * floor_us)),
                "rel_err_vs_bf16_layer": rel, "graph_equals_eager": graph_equal,
            })
            r = rows[-1]
            print(f"  {kind:9s} {t:5d} tokens: ours {ours_us:8.1f} us, bf16 {bf16_us:8.1f}, floor {floor_us:7.1f}"
                  f" ({r['ours_over_floor']:.2f}x), rel {rel:.1e}, graph==eager {graph_equal}", flush=True)
            del g, gb, g_out, gb_out
    _unforce_routing()
    del layer, bf16, w13, w2
    torch.cuda.empty_cache()
    return rows


def write_results(rows, out_dir, tag, command):
    import triton

    os.makedirs(out_dir, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": command, "rooflines": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS}}
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# NVFP4 MoE layer under skewed routing (w4a16, CUDA-graph replay)", "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}",
        f"- command: `{command}`",
        "- times: do_bench medians (us); bf16 = same routing and dispatch, dequantized weights, "
        "`torch._grouped_mm`; floor = max(touched FP4 weights + scales + shared + gate + activations / 3.0 TB/s, "
        "FLOPs / 749 TFLOP/s); meets = not slower than bf16 and <= 2x the floor", "",
        "| config | routing | tokens | max rows/expert | ours us | bf16 us | floor us | ours/floor | vs bf16 | meets "
        "| rel err vs bf16 | graph == eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['routing']} | {r['tokens']} | {r['max_rows_per_expert']} | {r['ours_us']:.1f} | "
            f"{r['bf16_us']:.1f} | {r['floor_us']:.1f} | {r['ours_over_floor']:.2f}x | "
            f"{r['speedup_vs_bf16']:.2f}x | {'yes' if r['meets'] else 'no'} | {r['rel_err_vs_bf16_layer']:.1e} | "
            f"{r['graph_equals_eager']} |")
    path = os.path.join(out_dir, f"{tag}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="v4-flash,v4-pro")
    p.add_argument("--tokens", default="8,64,512,4096")
    p.add_argument("--routings", default=",".join(ROUTINGS))
    p.add_argument("--rep-ms", type=int, default=25)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="moe_skew_v1")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU")
        return 2
    from megamoe.models.config import PRESETS

    command = "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    tokens = [int(t) for t in args.tokens.split(",")]
    routings = args.routings.split(",")
    rows = []
    for name in args.configs.split(","):
        rows += bench_config(PRESETS[name], tokens, routings, args.rep_ms)
        path = write_results(rows, args.out_dir, args.tag, command)  # partial results survive
    print(open(path).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
