"""Count the PyTorch ops of one V4 decode step, grouped by the innermost megamoe function that issued them.

The CUDA profile of a decode step (benchmarks/results/profile_decode_step_v1.md) shows hundreds of 1-3 us PyTorch
kernels. This script finds where they come from without a GPU: it runs the tiny model on the CPU with
``TRITON_INTERPRET=1`` (so that every op with a Triton kernel runs its launcher, whose interpreter work is not
counted) and records every aten op of one decode step with a ``TorchDispatchMode``, attributed to the innermost
stack frame inside ``megamoe/`` (``file:function``). Ops that launch no kernel on CUDA (views, ``empty``,
metadata) are left out; the rest is an estimate of the small PyTorch kernels a CUDA decode step launches (an op
on CUDA can launch more than one kernel, e.g. a float32 matmul's split-K reduction; a copy to a contiguous
layout counts once).

Usage: TRITON_INTERPRET=1 python benchmarks/count_decode_ops.py [--batch 1] [--steps 2] [--top 40]
(the variable is set here when missing; it must be set before triton is imported.)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megamoe.kvcache import DecodeBatch  # noqa: E402
from megamoe.models.config import V4_TINY_MODEL  # noqa: E402
from megamoe.models.model import V4Model  # noqa: E402
from megamoe.models.v4_weights import random_state_dict  # noqa: E402

#: aten ops that launch no CUDA kernel (views, allocation, metadata).
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "slice", "select",
    "as_strided", "unsqueeze", "squeeze", "alias", "detach", "empty", "empty_like", "empty_strided", "unflatten",
    "view_as_real", "view_as_complex", "split", "split_with_sizes", "unbind", "lift_fresh", "_to_copy_view",
    "flatten", "narrow", "chunk", "diagonal", "unfold", "conj", "_conj", "resolve_conj", "resolve_neg",
    "is_nonzero", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride", "numel", "is_same_size",
}

_PKG = os.sep + "megamoe" + os.sep

#: Sites whose ops are CPU-only (left out of the CUDA estimate): a kernel or no op there on CUDA.
CPU_ONLY = {
    "reference/kvcache.py:select_topk": "CUDA: the top-k kernel (megamoe.ops.topk)",
    "ops/errors.py:check_errors": "the eager error-word read (host), not part of a captured step",
}


def _site() -> str | None:
    """Innermost megamoe frame of the current stack (``path/file.py:function``); None inside Triton launches."""
    site = None
    for fr in traceback.extract_stack():
        f = fr.filename
        if os.sep + "triton" + os.sep in f:
            return None  # inside a Triton launch (the interpreter's own tensor work)
        i = f.rfind(_PKG)
        if i >= 0 and not f.endswith("count_decode_ops.py"):
            site = f"{f[i + len(_PKG):]}:{fr.name}"
    return site


class OpCounter(TorchDispatchMode):
    """Records (site, aten op name) of every kernel-launching op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_") if func.overloadpacket.__name__ != "_" else "_"
        base = func.overloadpacket.__name__
        if base not in NO_KERNEL and name not in NO_KERNEL:
            site = _site()
            if site is not None:
                self.ops.append((site, base))
        return func(*args, **(kwargs or {}))


def build(batch: int, prompt_len: int, seed: int = 0):
    cfg = V4_TINY_MODEL
    model = V4Model(cfg, max_batch=batch, max_prefill_tokens=prompt_len, max_slots=batch,
                    max_context=prompt_len + 64, device="cpu")
    model.load_weights(random_state_dict(cfg, seed=seed, device="cpu"))
    gen = torch.Generator().manual_seed(seed)
    for s in range(batch):
        model.prefill(s, torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen))
    return model


def count(batch: int = 1, steps: int = 2, prompt_len: int = 19):
    """Ops per decode step: (Counter {site: ops per step}, Counter {(site, op): ops per step}, layers)."""
    model = build(batch, prompt_len)
    dec = DecodeBatch.allocate(batch, "cpu")
    tokens = torch.zeros(batch, dtype=torch.int64)
    model.prepare_decode(dec, list(range(batch)))
    model.decode(dec, tokens)  # first call of a batch size allocates workspaces (host work outside graphs)
    counter = OpCounter()
    for _ in range(steps):
        model.prepare_decode(dec, list(range(batch)))
        with counter:
            model.decode(dec, tokens)
    by_site = collections.Counter(s for s, _ in counter.ops)
    by_op = collections.Counter(counter.ops)
    scale = 1.0 / steps
    return ({k: v * scale for k, v in by_site.items()}, {k: v * scale for k, v in by_op.items()},
            model.cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--ops", action="store_true", help="also list the aten ops of each site")
    ap.add_argument("--filter", default="", help="only sites containing this string")
    args = ap.parse_args()
    by_site, by_op, cfg = count(args.batch, args.steps)
    total = sum(by_site.values())
    cuda = sum(v for k, v in by_site.items() if k not in CPU_ONLY)
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    print(f"tiny model ({cfg.num_layers} layers: {', '.join(kinds)}), batch {args.batch}: "
          f"{total:g} kernel-launching PyTorch ops per decode step on the CPU, {cuda:g} of them also on CUDA "
          f"(Triton launches not counted; * = CPU only)\n")
    print("| ops/step | site |")
    print("|---|---|")
    for site, n in sorted(by_site.items(), key=lambda kv: (-kv[1], kv[0]))[:args.top]:
        if args.filter not in site:
            continue
        note = f" * {CPU_ONLY[site]}" if site in CPU_ONLY else ""
        print(f"| {n:g} | `{site}`{note} |")
        if args.ops:
            ops = sorted(((op, c) for (s, op), c in by_op.items() if s == site), key=lambda kv: -kv[1])
            print("|  | " + ", ".join(f"{op} x{c:g}" for op, c in ops) + " |")


if __name__ == "__main__":
    main()
