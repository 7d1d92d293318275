"""Hyper-connections of DeepSeek-V4 (validation and dispatch).

On CUDA (or the Triton interpreter) the kernels of ``megamoe.kernels.hyper_connection`` run: ``hc_pre`` fused
with the following RMSNorm (2 launches), ``hc_post`` (1 launch), ``hc_head`` fused with the final norm (2
launches), ``hc_post_pre``: ``hc_post`` fused with the next ``hc_pre`` / ``hc_head`` (2 launches instead of 3).
Elsewhere the PyTorch formulas of ``megamoe.reference.v4_numerics`` run, unchanged. The kernels'
outputs equal the formulas' except where a float32 summation order flips a rounding (the module docstring of
``megamoe.kernels.hyper_connection`` states the bound). All ops are sync-free and CUDA-graph capturable; they
allocate their outputs (and a small float32 workspace) per call.
"""
from __future__ import annotations

import torch

from ..reference import v4_numerics as nx
from ._dispatch import use_triton
from ._validate import check_real


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc: int, iters: int,
                      eps: float):
    """mixes (T, (2+hc)*hc) float32 -> (pre (T, hc), post (T, hc), comb (T, hc, hc)) float32 (see
    :func:`megamoe.reference.v4_numerics.hc_split_sinkhorn`)."""
    if not isinstance(mixes, torch.Tensor) or mixes.dtype != torch.float32 or mixes.dim() != 2:
        raise TypeError(f"mixes: expected a 2-D float32 tensor, got {getattr(mixes, 'dtype', type(mixes))}")
    _check_hc(hc)
    if mixes.shape[1] != (2 + hc) * hc:
        raise ValueError(f"mixes: expected {(2 + hc) * hc} columns for hc={hc}, got {mixes.shape[1]}")
    _check_params(mixes.device, ("hc_scale", hc_scale, (3,)), ("hc_base", hc_base, ((2 + hc) * hc,)))
    _check_iters(iters)
    check_real(eps, "eps", non_negative=True)
    if use_triton(mixes):
        from ..kernels.hyper_connection import launch_hc_split_sinkhorn

        return launch_hc_split_sinkhorn(mixes.contiguous(), hc_scale.contiguous(), hc_base.contiguous(), hc, iters,
                                        float(eps))
    return nx.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc, iters, eps)


def hc_pre(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc: int,
           iters: int, hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None,
           rms_eps: float | None = None):
    """``Block.hc_pre``, optionally fused with the RMSNorm that follows it (``attn_norm`` / ``ffn_norm``).

    x (T, hc, D) bf16; hc_fn ((2+hc)*hc, hc*D), hc_scale (3,), hc_base ((2+hc)*hc,) float32; norm_weight (D,)
    float32 or None; rms_eps: the norm's eps (default ``norm_eps``, as in the official model).
    -> (y (T, D) bf16, post (T, hc) float32, comb (T, hc, hc) float32): ``y = bf16(sum_k pre_k x_k)``, then, with
    a weight, ``rms_norm(y, norm_weight, rms_eps)`` (the official rounding points: the bf16 ``y`` is normed).
    iters: an int >= 1 (not a bool); hc_eps, norm_eps, rms_eps: finite floats >= 0 (TypeError / ValueError naming
    the argument otherwise; the same rules in :func:`hc_split_sinkhorn`, :func:`hc_head`, :func:`hc_post_pre`).
    """
    T, D = _check_x(x, hc)
    _check_iters(iters)
    _check_params(x.device, ("hc_fn", hc_fn, ((2 + hc) * hc, hc * D)), ("hc_scale", hc_scale, (3,)),
                  ("hc_base", hc_base, ((2 + hc) * hc,)))
    _check_weight(norm_weight, x.device, D)
    rms_eps = _check_eps_args(hc_eps, norm_eps, rms_eps)
    if use_triton(x):
        from ..kernels.hyper_connection import launch_hc_pre

        y, _, post, comb = launch_hc_pre(x.contiguous(), hc_fn.contiguous(), hc_scale.contiguous(),
                                         hc_base.contiguous(), _contig(norm_weight), iters=iters,
                                         hc_eps=float(hc_eps), norm_eps=float(norm_eps), rms_eps=float(rms_eps))
        return y, post, comb
    y, post, comb = nx.hc_pre(x, hc_fn, hc_scale, hc_base, hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    if norm_weight is not None:
        y = nx.rms_norm(y, norm_weight, rms_eps)
    return y, post, comb


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Block.hc_post``: y (T, D) bf16, residual (T, hc, D) bf16, post (T, hc), comb (T, hc, hc) float32 ->
    (T, hc, D) bf16, ``post[k] * y + sum_j comb[j, k] * residual[j]`` in float32, rounded once."""
    _check_post_inputs(y, residual, post, comb)
    if use_triton(residual):
        from ..kernels.hyper_connection import launch_hc_post

        return launch_hc_post(y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous())
    return nx.hc_post(y, residual, post, comb)


def hc_head(x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *, hc_eps: float,
            norm_eps: float, norm_weight: torch.Tensor | None = None, rms_eps: float | None = None) -> torch.Tensor:
    """``ParallelHead.hc_head``, optionally fused with the final ``norm``: x (T, hc, D) bf16, hc_fn (hc, hc*D),
    hc_scale (1,), hc_base (hc,) float32, norm_weight (D,) float32 or None -> (T, D) bf16
    (``bf16(sum_k pre_k x_k)`` with ``pre = sigmoid(mix * scale + base) + hc_eps``, then the RMSNorm)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise TypeError(f"x: expected a (T, hc, D) tensor, got {getattr(x, 'shape', type(x))}")
    hc = x.shape[1]
    T, D = _check_x(x, hc)
    _check_params(x.device, ("hc_fn", hc_fn, (hc, hc * D)), ("hc_scale", hc_scale, (1,)), ("hc_base", hc_base, (hc,)))
    _check_weight(norm_weight, x.device, D)
    rms_eps = _check_eps_args(hc_eps, norm_eps, rms_eps)
    if use_triton(x):
        from ..kernels.hyper_connection import launch_hc_pre

        return launch_hc_pre(x.contiguous(), hc_fn.contiguous(), hc_scale.contiguous(), hc_base.contiguous(),
                             _contig(norm_weight), iters=1, hc_eps=float(hc_eps), norm_eps=float(norm_eps),
                             rms_eps=float(rms_eps), head=True)[0]
    y = nx.hc_head(x, hc_fn, hc_scale, hc_base, hc_eps=hc_eps, norm_eps=norm_eps)
    return y if norm_weight is None else nx.rms_norm(y, norm_weight, rms_eps)


#: :func:`hc_post_pre` fuses only while ``T * D`` is at most this (host shapes). H100 graph replay
#: (benchmarks/results/gpu_check_v10/hyper_connection_v2.md, one layer's hc chain, fused vs unfused): V4-Flash
#: T = 1 / 8 / 64: 22.3 / 32.8 / 94.1 vs 26.3 / 35.0 / 66.9 us; V4-Pro T = 1 / 8 / 64: 34.2 / 67.2 / 173.8 vs
#: 38.1 / 55.5 / 117.1 us. Above it the op runs :func:`hc_post` then :func:`hc_pre` / :func:`hc_head`.
FUSED_MAX_ELEMENTS = 8 * 4096


def hc_post_pre(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, hc_fn: torch.Tensor,
                hc_scale: torch.Tensor, hc_base: torch.Tensor, *, iters: int, hc_eps: float, norm_eps: float,
                norm_weight: torch.Tensor | None = None, rms_eps: float | None = None, head: bool = False):
    """:func:`hc_post` followed by the next :func:`hc_pre` (``head``: :func:`hc_head`), fused on CUDA: the hc_post
    kernel also emits the next mixes' partial dots (2 launches instead of 3, no re-read of the new residual stream
    for the GEMV).

    y, residual, post, comb as :func:`hc_post`; hc_fn, hc_scale, hc_base, norm_weight, rms_eps as :func:`hc_pre`
    (``head``: as :func:`hc_head`, ``iters`` unused). -> (h (T, hc, D) bf16 = ``hc_post(y, residual, post, comb)``,
    x (T, D) bf16, post (T, hc), comb (T, hc, hc) float32 = ``hc_pre(h, ...)``; ``head``: post and comb None).
    ``head`` must be a bool. Bit for bit the unfused ops' results (same kernels' arithmetic, same workspace split).
    Fused only up to :data:`FUSED_MAX_ELEMENTS` (``T * D``, where it measured faster); above, the unfused ops run.
    """
    if not isinstance(head, bool):
        raise TypeError(f"head: expected a bool, got {head!r}")
    T, hc, D = _check_post_inputs(y, residual, post, comb, non_empty=True)
    M = hc if head else (2 + hc) * hc
    _check_params(residual.device, ("hc_fn", hc_fn, (M, hc * D)), ("hc_scale", hc_scale, (1,) if head else (3,)),
                  ("hc_base", hc_base, (M,)))
    if not head:
        _check_iters(iters)
    _check_weight(norm_weight, residual.device, D)
    rms_eps = _check_eps_args(hc_eps, norm_eps, rms_eps)
    if not use_triton(residual) or T * D > FUSED_MAX_ELEMENTS:  # the ops one after the other (CPU: references)
        h = hc_post(y, residual, post, comb)
        if head:
            return h, hc_head(h, hc_fn, hc_scale, hc_base, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=norm_weight,
                              rms_eps=rms_eps), None, None
        x, post_n, comb_n = hc_pre(h, hc_fn, hc_scale, hc_base, hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                                   norm_weight=norm_weight, rms_eps=rms_eps)
        return h, x, post_n, comb_n
    from ..kernels.hyper_connection import launch_hc_post_pre

    h, x, _, post_n, comb_n = launch_hc_post_pre(
        y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous(), hc_fn.contiguous(),
        hc_scale.contiguous(), hc_base.contiguous(), _contig(norm_weight), iters=iters if not head else 1,
        hc_eps=float(hc_eps), norm_eps=float(norm_eps), rms_eps=float(rms_eps), head=head)
    return h, x, post_n, comb_n


# ------------------------------------------------------------------------------------------------ validation
def _check_post_inputs(y, residual, post, comb, non_empty: bool = False) -> tuple[int, int, int]:
    """:func:`hc_post`'s inputs (``non_empty``: also D >= 1); returns (T, hc, D)."""
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3:
        raise TypeError(f"residual: expected a (T, hc, D) tensor, got {getattr(residual, 'shape', type(residual))}")
    T, hc, D = residual.shape
    _check_hc(hc, "residual")
    if residual.dtype != torch.bfloat16:
        raise TypeError(f"residual: expected bfloat16, got {residual.dtype}")
    if non_empty and D < 1:
        raise ValueError(f"residual: expected a non-empty hidden dim, got {tuple(residual.shape)}")
    if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16:
        raise TypeError(f"y: expected a bfloat16 tensor, got {getattr(y, 'dtype', type(y))}")
    if tuple(y.shape) != (T, D):
        raise ValueError(f"y: expected shape {(T, D)} (residual is {tuple(residual.shape)}), got {tuple(y.shape)}")
    _check_params(residual.device, ("y", y, (T, D)), ("post", post, (T, hc)), ("comb", comb, (T, hc, hc)),
                  dtypes={"y": torch.bfloat16})
    return T, hc, D


def _contig(t):
    return None if t is None else t.contiguous()


def _check_hc(hc, name="hc"):
    if isinstance(hc, bool) or not isinstance(hc, int) or hc < 1 or hc & (hc - 1):
        raise ValueError(f"{name}: expected hc a power of two, got {hc!r}")


def _check_iters(iters):
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters: expected a positive int, got {iters!r}")


def _check_eps_args(hc_eps, norm_eps, rms_eps):
    """hc_eps, norm_eps and rms_eps (None: norm_eps) checked; returns the rms_eps to use."""
    check_real(hc_eps, "hc_eps", non_negative=True)
    check_real(norm_eps, "norm_eps", non_negative=True)
    if rms_eps is None:
        return norm_eps
    check_real(rms_eps, "rms_eps", non_negative=True)
    return rms_eps


def _check_x(x, hc):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise TypeError(f"x: expected a (T, hc, D) tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected bfloat16, got {x.dtype}")
    _check_hc(hc)
    if x.shape[1] != hc:
        raise ValueError(f"x: expected {hc} hyper-connection copies (dim 1) for hc={hc}, got {tuple(x.shape)}")
    if x.shape[2] < 1:
        raise ValueError(f"x: expected a non-empty hidden dim, got {tuple(x.shape)}")
    return x.shape[0], x.shape[2]


def _check_params(device, *specs, dtypes=None):
    for name, t, shape in specs:
        want = (dtypes or {}).get(name, torch.float32)
        if not isinstance(t, torch.Tensor) or t.dtype != want:
            raise TypeError(f"{name}: expected a {want} tensor, got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _check_weight(w, device, D):
    if w is not None:
        _check_params(device, ("norm_weight", w, (D,)))
