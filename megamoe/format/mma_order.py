"""MMA K order of the activations for the Gluon wgmma NVFP4 GEMM's x ring (``X_RING``, v8).

The kernels decode each thread's contiguous packed weight bytes straight into MMA A-operand registers, so
the MMA's K axis runs in a permuted order within every 128-element K group (``nvfp4_gluon_jit.decode_a_operand``):
MMA position ``kappa = c0 + 2q + 8*c1 + 16*nib + 32*i`` holds memory element ``m = 32q + 8i + 4*c1 + 2*c0 + nib``
(q, i in 0..3; c0, c1, nib in 0..1). The activations must run in the same order. Today's kernels permute x in
registers every K step; :func:`to_mma_k_order` does it once per GEMM, outside the K loop, so x tiles can go
by ``cp.async`` straight into the shared-memory operand.

x (M, K) with K a multiple of 128 -> (M, K): ``out[:, 128*g + kappa] = x[:, 128*g + m(kappa)]``; exact (a
permutation of columns), any dtype.
"""
from __future__ import annotations

import torch

MMA_K_GROUP = 128  # the BLOCK_K of the kernels this order belongs to


def mma_k_permutation(device=None) -> torch.Tensor:
    """(128,) int64: position kappa of the MMA K order -> memory index m within a 128-element group."""
    m = torch.arange(MMA_K_GROUP, device=device).reshape(4, 4, 2, 2, 2)  # memory (q, i, c1, c0, nib)
    return m.permute(1, 4, 2, 0, 3).reshape(-1)  # read in MMA order (i, nib, c1, q, c0)


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"x: expected a 2-D torch.Tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[1] % MMA_K_GROUP:
        raise ValueError(f"x: K={x.shape[1]} must be a multiple of {MMA_K_GROUP} for the MMA K order")


def to_mma_k_order(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) -> (M, K) contiguous in MMA K order (see module docstring); ``out`` optional (M, K) buffer."""
    _check(x)
    m, k = x.shape
    perm = mma_k_permutation(x.device)
    src = x.reshape(m, k // MMA_K_GROUP, MMA_K_GROUP)
    if out is None:
        return src.index_select(2, perm).reshape(m, k)
    torch.index_select(src, 2, perm, out=out.view(m, k // MMA_K_GROUP, MMA_K_GROUP))
    return out


def from_mma_k_order(x_mma: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_mma_k_order`: (M, K) in MMA K order -> memory order."""
    _check(x_mma)
    m, k = x_mma.shape
    inverse = torch.argsort(mma_k_permutation(x_mma.device))
    return x_mma.reshape(m, k // MMA_K_GROUP, MMA_K_GROUP).index_select(2, inverse).reshape(m, k)
