"""Command-line entry point: ``python -m megamoe <command>``.

Commands live in ``megamoe/commands/``; each module exposes
``register(subparsers)`` that adds its subparser and sets ``func``. They are
imported lazily so that ``--help`` stays fast and one broken command cannot
take the others down.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: (command module, one-line help used when the module cannot be imported)
COMMANDS = (
    ("generate", "DeepSeek-V4 model: prefill prompts and decode tokens (main job)"),
    ("run", "run a DeepSeek-V4-shaped NVFP4 MoE layer through the fast path and the reference"),
    ("bench", "benchmark the NVFP4 MoE layer against bf16 and the roofline"),
    ("quantize_check", "quantize a random tensor through the kernel and the reference and compare bit for bit"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe",
        description="NVFP4 MoE kernels for DeepSeek-V4-class models (Hopper: in-kernel FP4 decode; CPU: references).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, fallback_help in COMMANDS:
        try:
            module = importlib.import_module(f"megamoe.commands.{module_name}")
        except ImportError as error:  # keep the CLI usable if one command is unavailable
            name = module_name.replace("_", "-")
            sub = subparsers.add_parser(name, help=f"{fallback_help} [unavailable: {error}]")
            sub.set_defaults(func=lambda args, error=error: _unavailable(error))
            continue
        module.register(subparsers)
    return parser


def _unavailable(error: Exception) -> int:
    print(f"this command is unavailable: {error}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
