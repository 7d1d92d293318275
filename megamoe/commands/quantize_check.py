"""``python -m megamoe quantize-check``: the fused quantize kernel against the reference, bit for bit.

Quantizes a random Gaussian (rows, cols) tensor through the Triton kernels and
through the PyTorch reference, prints the round-trip error of the kernel
result against the input and whether both agree bit for bit (packed bytes,
block-scale bytes, global-scale bits, and the dequantized values). Exit code
1 on any mismatch.

Device: ``--device auto`` takes CUDA when available, else the CPU. On the CPU
the kernels run through the Triton interpreter: this command sets
``TRITON_INTERPRET=1`` itself before ``triton`` is first imported (the
interpreter is slow; keep ``--rows``/``--cols`` small, e.g. 64 x 512). If
``triton`` was already imported without the variable, it reports that and
exits with 2.
"""
from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize-check",
        help="quantize a random tensor through the kernel and the reference and compare bit for bit",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--rows", type=int, default=64, help="rows M of the random input (default 64)")
    parser.add_argument("--cols", type=int, default=512, help="columns K, a multiple of 16 (default 512)")
    parser.add_argument("--per-row", action="store_true", help="dynamic per-row global scale (default per tensor)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _device(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("quantize-check: --device cuda requested but no CUDA device is available")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def run(args) -> int:
    if args.rows < 0 or args.cols <= 0 or args.cols % 16:
        print(f"quantize-check: --rows must be >= 0 and --cols a positive multiple of 16, got "
              f"{args.rows} x {args.cols}", file=sys.stderr)
        return 2
    device = _device(args.device)
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("quantize-check: triton was imported before TRITON_INTERPRET=1 could be set; "
                  "run with TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from megamoe.ops.quantize import dequantize, quantize
    from megamoe.reference.quantize import dequantize as ref_dequantize
    from megamoe.reference.quantize import quantize as ref_quantize

    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.rows, args.cols, generator=generator).to(dtype)
    got = quantize(x.to(device), per_row=args.per_row)
    want = ref_quantize(x, per_row=args.per_row)
    checks = {
        "packed bytes": torch.equal(got.data.cpu(), want.data),
        "block-scale bytes": torch.equal(got.block_scale.cpu().view(torch.uint8), want.block_scale.view(torch.uint8)),
        "global-scale bits": torch.equal(got.global_scale.cpu().reshape(-1).view(torch.int32),
                                         want.global_scale.reshape(-1).view(torch.int32)),
    }
    back = dequantize(got, torch.float32).cpu()
    checks["dequantized values"] = torch.equal(back, ref_dequantize(want, torch.float32))
    xf = x.float()
    rel = (back - xf).norm() / xf.norm().clamp_min(1e-30)
    mode = "per-row" if args.per_row else "per-tensor"
    path = "Triton (CUDA)" if device == "cuda" else "Triton interpreter (CPU)"
    print(f"quantize-check: x ({args.rows}, {args.cols}) {args.dtype}, {mode} dynamic global scale, kernel via {path}")
    print(f"  round-trip relative RMS error ||dequantize(quantize(x)) - x|| / ||x|| = {rel.item():.5f}")
    for name, ok in checks.items():
        print(f"  kernel == reference ({name}): {'yes' if ok else 'NO'}")
    ok = all(checks.values())
    print("OK: bit-exact" if ok else "MISMATCH")
    return 0 if ok else 1
