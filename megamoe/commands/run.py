"""``python -m megamoe run``: the main job.

Builds a DeepSeek-V4-shaped NVFP4 MoE layer (V4-Flash dims on a GPU, a small
embedded configuration on CPU), with random bf16 weights quantized to NVFP4 or
loaded from a ModelOpt ``--checkpoint``, runs one batch through the fast path
and the float32 reference (same routing), and prints the relative error, the
time per call and the achieved bandwidth / TFLOP/s.
"""
from __future__ import annotations

import time

import torch


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a DeepSeek-V4-shaped NVFP4 MoE layer (fast path vs reference)")
    p.add_argument("--tokens", type=int, default=None, help="batch size (default: 64 on GPU, 8 on CPU)")
    p.add_argument("--mode", choices=("w4a16", "w4a4", "w4a8"), default="w4a16",
                   help="w4a8: FP8 tensor cores for prefill-sized GEMMs (>= 48 rows per expert), w4a16 below")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replay (GPU) and check it equals eager")
    p.add_argument("--config", default=None,
                   help="preset: v4-flash, v4-pro, guide, small (default: v4-flash on GPU, small on CPU)")
    p.add_argument("--checkpoint", default=None, help="ModelOpt NVFP4 .safetensors with the MoE block's tensors")
    p.add_argument("--prefix", default="", help="tensor-name prefix inside --checkpoint (e.g. model.layers.3.mlp.)")
    p.add_argument("--calibrate", action="store_true", help="w4a4: static activation scales from the batch")
    p.add_argument("--iters", type=int, default=None, help="timing iterations on CPU (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep", action="store_true",
                   help="expert parallelism over the ranks of 'torchrun --nproc-per-node N -m megamoe run --ep' "
                        "(NCCL on GPUs, gloo on CPU); --tokens is per rank")
    p.add_argument("--no-check", action="store_true", help="--ep: skip the single-process comparison")
    p.set_defaults(func=main)


def _layer_flops_and_bytes(layer, x, topk_ids) -> tuple[float, float, int]:
    c = layer.config
    t = x.shape[0]
    touched = int(torch.unique(topk_ids).numel())  # outside the timed region
    flops = 2.0 * t * c.num_experts * c.hidden_size  # gate
    flops += 2.0 * t * c.top_k * 3 * c.intermediate_size * c.hidden_size
    flops += 2.0 * t * 3 * c.shared_intermediate_size * c.hidden_size
    act_bytes = 2 * t * c.hidden_size * 2 + 2 * t * c.top_k * (c.intermediate_size + c.hidden_size) * 2
    return flops, float(layer.weight_bytes(touched) + act_bytes), touched


def main(args) -> int:
    if getattr(args, "ep", False):
        from ..distributed.launch import main_ep

        return main_ep(args)
    from ..layers.moe import Nvfp4MoE
    from ..models.config import PRESETS

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = args.config or ("v4-flash" if cuda else "small")
    if preset not in PRESETS:
        print(f"--config: expected one of {sorted(PRESETS)}, got {preset!r}")
        return 2
    config = PRESETS[preset]
    tokens = args.tokens if args.tokens is not None else (64 if cuda else 8)
    if tokens < 1:
        print(f"--tokens: expected >= 1, got {tokens}")
        return 2
    if args.iters is not None and args.iters < 1:
        print(f"--iters: expected >= 1, got {args.iters}")
        return 2
    t0 = time.perf_counter()
    if args.checkpoint:
        from ..checkpoint import load_moe_layer

        layer = load_moe_layer(args.checkpoint, config, prefix=args.prefix, max_num_tokens=tokens, device=device,
                               mode=args.mode)
        source = f"checkpoint {args.checkpoint}"
    else:
        layer = Nvfp4MoE.random(config, seed=args.seed, max_num_tokens=tokens, device=device, mode=args.mode)
        source = "random bf16 weights quantized to NVFP4"
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    x = torch.randn((tokens, config.hidden_size), generator=gen, device=device).to(torch.bfloat16)
    if args.mode == "w4a4" and args.calibrate:
        layer.calibrate(x)
    build_s = time.perf_counter() - t0
    c = config
    print(f"megamoe run: {c.name} (H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, top-{c.top_k}, "
          f"shared I={c.shared_intermediate_size}, scoring={c.scoring_func}), {tokens} tokens, mode={args.mode}, "
          f"device={torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"weights: {source} (built in {build_s:.1f} s)")

    out = layer.forward(x).clone()
    routing = layer.last_routing
    ref = layer.reference_forward(x, routing)
    rel = ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    routing_same = bool(torch.equal(layer.route(x)[1], routing[1]))
    print(f"relative error vs float32 reference (decoded weights, same routing): {rel:.2e}"
          f" ({'ok' if rel < 1e-2 or args.mode == 'w4a4' else 'ABOVE 1e-2'}); routing reproducible: {routing_same}")
    if args.mode != "w4a16":  # the mode's own error: against the float32 w4a16 reference on the same weights
        layer_mode = layer.mode
        layer.set_mode("w4a16")
        ref16 = layer.reference_forward(x, routing)
        layer.set_mode(layer_mode)
        rel16 = ((out.float() - ref16).norm() / ref16.norm().clamp(min=1e-30)).item()
        print(f"relative error vs float32 w4a16 reference (same weights, same routing): {rel16:.2e}")

    fn = lambda: layer.forward(x)  # noqa: E731
    if args.graph:
        if not cuda:
            print("--graph: needs a CUDA GPU; timing eager instead")
        else:
            replay = layer.capture(tokens)
            graph_out = replay(x).clone()
            print(f"graph replay == eager: {torch.equal(graph_out, out)}")
            fn = lambda: replay(x)  # noqa: E731
    if cuda:
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    else:
        iters = args.iters or 3
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - start) * 1e3 / iters
    flops, nbytes, touched = _layer_flops_and_bytes(layer, x, routing[1])
    print(f"time per call: {ms * 1e3:.1f} us ({'graph replay' if args.graph and cuda else 'eager'}); "
          f"experts touched {touched}/{c.num_experts}")
    print(f"achieved: {nbytes / (ms * 1e-3) / 1e9:.3g} GB/s of weights+activations, {flops / (ms * 1e-3) / 1e12:.3g} "
          f"TFLOP/s" + (f" (HBM roofline 3.0 TB/s: {nbytes / 3.0e12 * 1e6:.1f} us)" if cuda else ""))
    return 0 if (rel < 1e-2 or args.mode == "w4a4") else 1
