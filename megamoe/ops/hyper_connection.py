"""Hyper-connections of DeepSeek-V4 (validation and dispatch): the Sinkhorn mixing weights run as one Triton
kernel on CUDA (``megamoe.kernels.hyper_connection``), the PyTorch formula of
``megamoe.reference.v4_numerics`` elsewhere."""
from __future__ import annotations

import torch

from ..reference import v4_numerics as nx
from ._dispatch import use_triton


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc: int, iters: int,
                      eps: float):
    """mixes (T, (2+hc)*hc) float32 -> (pre (T, hc), post (T, hc), comb (T, hc, hc)) float32 (see
    :func:`megamoe.reference.v4_numerics.hc_split_sinkhorn`)."""
    if not isinstance(mixes, torch.Tensor) or mixes.dtype != torch.float32 or mixes.dim() != 2:
        raise TypeError(f"mixes: expected a 2-D float32 tensor, got {getattr(mixes, 'dtype', type(mixes))}")
    if not isinstance(hc, int) or hc < 1 or hc & (hc - 1):
        raise ValueError(f"hc: expected a power of two, got {hc!r}")
    if mixes.shape[1] != (2 + hc) * hc:
        raise ValueError(f"mixes: expected {(2 + hc) * hc} columns for hc={hc}, got {mixes.shape[1]}")
    for name, t, n in (("hc_scale", hc_scale, 3), ("hc_base", hc_base, (2 + hc) * hc)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (n,):
            raise ValueError(f"{name}: expected a ({n},) float32 tensor")
        if t.device != mixes.device:
            raise ValueError(f"{name}: expected device {mixes.device}, got {t.device}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters: expected a positive int, got {iters!r}")
    if use_triton(mixes):
        from ..kernels.hyper_connection import launch_hc_split_sinkhorn

        return launch_hc_split_sinkhorn(mixes.contiguous(), hc_scale.contiguous(), hc_base.contiguous(), hc, iters,
                                        float(eps))
    return nx.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc, iters, eps)


def hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc: int,
           iters: int, hc_eps: float, norm_eps: float):
    """``Block.hc_pre`` with the fused Sinkhorn: x (T, hc, D) -> (y (T, D) x.dtype, post (T, hc), comb (T, hc, hc))."""
    mixes = nx.hc_mixes(x, hc_fn, norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, hc_scale, hc_base, hc=hc, iters=iters, eps=hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)
    return y.to(x.dtype), post, comb
