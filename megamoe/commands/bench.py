"""``python -m megamoe bench``: the MoE layer benchmark (benchmarks/bench_moe.py logic) with a progress bar.

Writes JSON, a markdown table and a plot to ``benchmarks/results/`` (``--out-dir``).
"""
from __future__ import annotations

import importlib.util
import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark the NVFP4 MoE layer vs bf16 and the HBM roofline (GPU)")
    p.add_argument("--configs", default="v4-flash,guide", help="comma-separated presets (v4-flash, guide, small)")
    p.add_argument("--tokens", default="1,8,64,512,4096", help="comma-separated token counts")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    p.add_argument("--tag", default="moe_v1")
    p.add_argument("--fuse-shared-max-tokens", type=int, default=None,
                   help="run the shared expert inside the routed GEMMs up to this many tokens (default: the layer's)")
    p.set_defaults(func=main)


def _bench_module():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "benchmarks", "bench_moe.py")
    spec = importlib.util.spec_from_file_location("megamoe_bench_moe", path)
    if spec is None or not os.path.exists(path):
        raise FileNotFoundError(f"bench: benchmarks/bench_moe.py not found next to the package ({path})")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(args) -> int:
    command = "python -m megamoe bench " + " ".join(sys.argv[2:])
    return _bench_module().run(args, command=command.strip())
