"""The shared expert alone: its two GEMMs as dense GEMMs (``Nvfp4SharedExpert.dense_routes``: split-K with the SwiGLU
in its reduction, ``moe.SHARED_SPLITK``; from 512 rows route "dense-bf16", cuBLAS on the exactly dequantized weight,
``moe.SHARED_DENSE_BF16``) against grouped GEMMs of one expert (the path before), the bf16 PyTorch FFN on already
dequantized weights, and the floor.

Per config (V4-Flash: H 4096, shared width 2048; V4-Pro: 7168 / 3072) and token count: us per forward in CUDA-graph
replay (do_bench median, the L2 cleared before each replay by ``--flush``), the floor = max(weight + scale bytes /
3.0 TB/s, FLOPs / 749 TFLOP/s), and each path's error against the float32 reference (relative Frobenius norm).

Usage: python benchmarks/bench_shared_expert.py [--configs v4-flash,v4-pro] [--tokens 9,16,32,64,128,256]
[--class-rows 256] [--force-bf16] [--flush read] [--out PATH.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

HBM_BYTES_PER_S = 3.0e12
BF16_FLOPS = 749e12


def main() -> int:
    from graph_timing import add_flush_argument, graph_replay_us, use_flush_mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v4-flash,v4-pro")
    ap.add_argument("--tokens", default="9,16,32,64,128,256")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--class-rows", type=int, default=0,
                    help="also time the split-K path with every dense shape class's split-K bound raised to this many "
                         "rows (nvfp4_splitk.DENSE_SPLITK_MAX_ROWS), e.g. 256: is split-K also the faster down GEMM "
                         "above 64 rows?")
    ap.add_argument("--force-bf16", action="store_true",
                    help="also time route dense-bf16 at every size (no split-K): where does it start to win?")
    add_flush_argument(ap, default="read")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_shared_expert.py needs a CUDA GPU")
        return 0
    use_flush_mode(args.flush)
    from megamoe.kernels.gemm import nvfp4_splitk
    from megamoe.layers import moe as moe_mod
    from megamoe.models.config import PRESETS
    from megamoe.ops import gemm as gemm_ops
    from megamoe.ops.quantize import dequantize, quantize
    from megamoe.reference.moe import swiglu

    dev = torch.device("cuda")
    tokens = [int(v) for v in args.tokens.split(",")]
    # module settings per variant (restored after each): "dense" the defaults (split-K / dense-bf16 where they apply),
    # "grouped" both off (the path before), "raised" split-K's class bound raised, "forced" dense-bf16 at every size
    knobs = [(moe_mod, "SHARED_SPLITK"), (moe_mod, "SHARED_DENSE_BF16"), (nvfp4_splitk, "DENSE_SPLITK_MAX_ROWS"),
             (gemm_ops, "DENSE_BF16_MIN_ROWS"), (gemm_ops, "DENSE_BF16_WIDE_MIN_ROWS")]
    defaults = {name: getattr(mod, name) for mod, name in knobs}
    variants = {"dense": {}, "grouped": dict(SHARED_SPLITK=False, SHARED_DENSE_BF16=False)}
    if args.class_rows:
        variants["raised"] = dict(DENSE_SPLITK_MAX_ROWS=tuple(
            (cls, size, max(rows, args.class_rows)) for cls, size, rows in defaults["DENSE_SPLITK_MAX_ROWS"]))
    if args.force_bf16:
        variants["forced"] = dict(SHARED_SPLITK=False, DENSE_BF16_MIN_ROWS=1, DENSE_BF16_WIDE_MIN_ROWS=1)
    lines = ["# Shared expert alone: its GEMMs as dense GEMMs (split-K, dense-bf16) vs grouped one-expert GEMMs\n",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; device: {torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}; triton {triton.__version__}; flush {args.flush}",
             f"- command: `python {' '.join(sys.argv)}`",
             "- us: CUDA-graph replay, do_bench median; floor = max(weight + scale bytes / 3.0 TB/s, FLOPs / 749 "
             "TFLOP/s); err: relative Frobenius error against the float32 reference on the decoded weights",
             "- dense: the defaults (`dense_routes`: (gate_up, down) on nvfp4_linear, else grouped); grouped: "
             "SHARED_SPLITK and SHARED_DENSE_BF16 off (the path before); raised: split-K's class bound at "
             f"{args.class_rows} rows (`--class-rows`, 0: not run); forced: route dense-bf16 at every size, no split-K "
             f"(`--force-bf16`: {args.force_bf16})", "",
             "| config | tokens | dense us (routes) | grouped us | speed-up | raised us | forced us | bf16 us | floor us "
             "| dense % of floor | err dense | err grouped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.configs.split(","):
        c = PRESETS[name]
        h, i = c.hidden_size, c.shared_intermediate_size
        g = torch.Generator().manual_seed(0)
        w13 = quantize((torch.randn(2 * i, h, generator=g) * 0.02).to(dev))
        w2 = quantize((torch.randn(h, i, generator=g) * 0.02).to(dev))
        shared = moe_mod.Nvfp4SharedExpert(h, i, max_num_tokens=max(tokens), device=dev, swiglu_limit=c.swiglu_limit)
        shared.load_weights(w13, w2)
        w13_bf16, w2_bf16 = dequantize(w13, torch.bfloat16), dequantize(w2, torch.bfloat16)
        weight_bytes = sum(w.data.numel() + w.block_scale.numel() for w in (w13, w2))

        def bf16_ffn(x):
            gate_up = F.linear(x, w13_bf16)
            return F.linear(swiglu(gate_up[:, :i], gate_up[:, i:], c.swiglu_limit), w2_bf16)

        for t in tokens:
            x = torch.randn(t, h, device=dev, generator=torch.Generator(device=dev).manual_seed(t)).bfloat16()
            ref = shared.reference_forward(x)
            result = {}
            for label, settings in variants.items():
                for mod, knob in knobs:
                    setattr(mod, knob, settings.get(knob, defaults[knob]))
                try:
                    out = shared.forward(x).clone()
                    us = graph_replay_us(lambda: shared.forward(x), warmup=25, rep=args.rep_ms)
                    routes = shared.dense_routes(x, "w4a16")
                finally:
                    for mod, knob in knobs:
                        setattr(mod, knob, defaults[knob])
                err = ((out.float() - ref).norm() / ref.norm()).item()
                result[label] = (us, err, routes)
            bf16_us = graph_replay_us(lambda: bf16_ffn(x), warmup=25, rep=args.rep_ms)
            floor = max(weight_bytes / HBM_BYTES_PER_S, 2 * t * (2 * i * h + h * i) / BF16_FLOPS) * 1e6
            (d_us, d_err, routes), (g_us, g_err, _) = result["dense"], result["grouped"]
            r_us = result.get("raised", (float("nan"),))[0]
            f_us = result.get("forced", (float("nan"),))[0]
            flags = "".join("d" if r else "g" for r in routes)
            print(f"{name} T={t}: dense {d_us:.1f} us ({flags}) grouped {g_us:.1f} raised {r_us:.1f} forced {f_us:.1f} "
                  f"bf16 {bf16_us:.1f} floor {floor:.1f}", flush=True)
            lines.append(f"| {name} | {t} | {d_us:.1f} ({flags}) | {g_us:.1f} | {g_us / d_us:.2f}x | {r_us:.1f} | "
                         f"{f_us:.1f} | {bf16_us:.1f} | {floor:.1f} | {100 * floor / d_us:.0f}% | {d_err:.1e} | "
                         f"{g_err:.1e} |")
        lines.append("")
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
