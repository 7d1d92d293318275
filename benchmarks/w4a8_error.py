"""Layer error of each activation mode against the float32 w4a16 reference on the same weights (issue 13).

For one random NVFP4 MoE layer (``Nvfp4MoE.random``) and one batch: ``forward`` in w4a16, w4a4 (dynamic
per-row scales) and w4a8, each compared with the float32 w4a16 reference (decoded weights, bf16 input, same
routing): ``||out - ref|| / ||ref||``, the README's metric. On CPU ``forward`` runs the PyTorch references
(or the Triton interpreter with TRITON_INTERPRET=1); on a GPU the kernels (w4a8 runs its FP8 kernels only
at >= 64 rows per expert: use enough tokens, e.g. 4096 on V4-Flash).

Usage: python benchmarks/w4a8_error.py [--config v4-flash] [--experts E] [--top-k K] [--tokens 4096] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def layer_errors(config, tokens: int, seed: int = 0, device=None) -> dict:
    """{mode: relative error vs the float32 w4a16 reference} for w4a16, w4a4, w4a8."""
    from megamoe.layers.moe import Nvfp4MoE

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    layer = Nvfp4MoE.random(config, seed=seed, max_num_tokens=tokens, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn((tokens, config.hidden_size), generator=gen, device=device).to(torch.bfloat16)
    routing = layer.route(x)
    layer.set_mode("w4a16")
    ref = layer.reference_forward(x, routing)
    errors = {}
    for mode in ("w4a16", "w4a4", "w4a8"):
        layer.set_mode(mode)
        out = layer.forward(x).float()
        errors[mode] = ((out - ref).norm() / ref.norm()).item()
    return errors


def main(argv=None) -> int:
    from megamoe.models.config import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v4-flash" if torch.cuda.is_available() else "small")
    p.add_argument("--experts", type=int, default=None, help="override num_experts (CPU-sized runs)")
    p.add_argument("--top-k", type=int, default=None, help="override top_k")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = PRESETS[args.config]
    changes = {}
    if args.experts is not None:
        changes["num_experts"] = args.experts
        changes["n_group"], changes["topk_group"] = 1, 1
    if args.top_k is not None:
        changes["top_k"] = args.top_k
    if changes:
        config = dataclasses.replace(config, **changes)
    tokens = args.tokens or (4096 if torch.cuda.is_available() else 64)
    errors = layer_errors(config, tokens, args.seed)
    print(f"{config.name} H={config.hidden_size} I={config.intermediate_size} E={config.num_experts} "
          f"top-{config.top_k}, {tokens} tokens: relative error vs float32 w4a16 reference: "
          + ", ".join(f"{m} {e:.2e}" for m, e in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
