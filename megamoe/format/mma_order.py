"""MMA K order of the activations for the Gluon wgmma NVFP4 GEMM's x ring (``X_RING``, v8).

The kernels decode each thread's contiguous packed weight bytes straight into MMA A-operand registers, so
the MMA's K axis runs in a permuted order within every 128-element K group (``nvfp4_gluon_jit.decode_a_operand``):
MMA position ``kappa = c0 + 2q + 8*c1 + 16*nib + 32*i`` holds memory element ``m = 32q + 8i + 4*c1 + 2*c0 + nib``
(q, i in 0..3; c0, c1, nib in 0..1). The activations must run in the same order. A kernel with K steps of
``block_k`` (128 or 256 here) permutes within groups of that size: i in 0..block_k/32-1 and
``m = (block_k/4) q + 8i + 4*c1 + 2*c0 + nib``. Today's kernels permute x in
registers every K step; :func:`to_mma_k_order` does it once per GEMM, outside the K loop, so x tiles can go
by ``cp.async`` straight into the shared-memory operand.

x (M, K) with K a multiple of block_k -> (M, K): ``out[:, block_k*g + kappa] = x[:, block_k*g + m(kappa)]``; exact
(a permutation of columns), any dtype.
"""
from __future__ import annotations

import torch

MMA_K_GROUP = 128  # the default group: the wgmma kernel's BLOCK_K


def mma_k_permutation(device=None, block_k: int = MMA_K_GROUP) -> torch.Tensor:
    """(block_k,) int64: position kappa of the MMA K order -> memory index m within a block_k group."""
    if block_k not in (128, 256):
        raise ValueError(f"block_k: expected 128 or 256, got {block_k!r}")
    m = torch.arange(block_k, device=device).reshape(4, block_k // 32, 2, 2, 2)  # memory (q, i, c1, c0, nib)
    return m.permute(1, 4, 2, 0, 3).reshape(-1)  # read in MMA order (i, nib, c1, q, c0)


def fp8_mma_k_permutation(device=None) -> torch.Tensor:
    """(128,) int64: position kappa of the FP8 MMA K order -> memory index m within a 128-element K group.

    The W4A8 pipelined kernel (``nvfp4_w4a8_pipe.py``) decodes word ``i`` of quad lane ``q``'s four (memory
    ``m = 32q + 8i + e``, e = 0..7 its nibbles in order) into one FP8 wgmma k32 A fragment, whose lane q holds K
    positions ``4q + c`` in one register and ``16 + 4q + c`` in another (c = 0..3: the register's bytes): elements
    0-3 of the word go to the first, 4-7 to the second, so ``kappa = 32i + 16g + 4q + c`` <- ``m = 32q + 8i + 4g + c``.
    The FP8 activations run in the same order (the quantizer writes them that way)."""
    m = torch.arange(MMA_K_GROUP, device=device).reshape(4, 4, 2, 4)  # memory (q, i, g, c)
    return m.permute(1, 2, 0, 3).reshape(-1)  # read in MMA order (i, g, q, c)


def _check(x: torch.Tensor, block_k: int, order: str = "the MMA K order", name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"{name}: expected a 2-D torch.Tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[1] % block_k:
        raise ValueError(f"{name}: K={x.shape[1]} must be a multiple of {block_k} for {order}")


def to_mma_k_order(x: torch.Tensor, out: torch.Tensor | None = None, block_k: int = MMA_K_GROUP) -> torch.Tensor:
    """(M, K) -> (M, K) contiguous in the MMA K order of ``block_k`` steps (see module docstring); ``out``
    optional (M, K) buffer."""
    perm = mma_k_permutation(getattr(x, "device", None), block_k)
    _check(x, block_k)
    m, k = x.shape
    src = x.reshape(m, k // block_k, block_k)
    if out is None:
        return src.index_select(2, perm).reshape(m, k)
    torch.index_select(src, 2, perm, out=out.view(m, k // block_k, block_k))
    return out


def from_mma_k_order(x_mma: torch.Tensor, block_k: int = MMA_K_GROUP) -> torch.Tensor:
    """The inverse of :func:`to_mma_k_order`: (M, K) in MMA K order -> memory order."""
    inverse = torch.argsort(mma_k_permutation(getattr(x_mma, "device", None), block_k))
    _check(x_mma, block_k)
    m, k = x_mma.shape
    return x_mma.reshape(m, k // block_k, block_k).index_select(2, inverse).reshape(m, k)


#: The paired order's permutation within every 8 consecutive K elements: position j holds element PAIRED_PERM[j].
PAIRED_PERM = (0, 2, 4, 6, 1, 3, 5, 7)


def to_paired_order(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) -> (M, K) contiguous in the *paired* order of the mma.sync decode kernel (``X_PAIRED``).

    Within every 8 consecutive K elements (one packed weight word) position ``c0 + 2*c1 + 4*nib`` holds memory
    element ``nib + 2*c0 + 4*c1`` (``x0 x2 x4 x6 x1 x3 x5 x7``): the bf16 pairs that one MMA operand register holds in
    the K order of :func:`mma_k_permutation` (``c0`` the pair's halves) are then adjacent, so the kernel moves whole
    32-bit pairs into the MMA operand instead of building them with byte permutes. Unlike the MMA K order it does
    not depend on the kernel's K step (a thread's K range is a multiple of 8 for every BLOCK_K). Exact (a column
    permutation, any dtype); K % 8 == 0. ``out``: optional (M, K) buffer.
    """
    _check(x, 8, "the paired order")
    m, k = x.shape
    # (m, g, a, b) element 2a + b -> position 4b + a: PAIRED_PERM without a host index tensor (graph-capturable)
    src = x.reshape(m, k // 8, 4, 2).transpose(2, 3)
    if out is None:
        return src.reshape(m, k)
    out.view(m, k // 8, 2, 4).copy_(src)
    return out


def from_paired_order(x_paired: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_paired_order`: (M, K) in the paired order -> memory order (a new tensor)."""
    _check(x_paired, 8, "the paired order", "x_paired")
    m, k = x_paired.shape
    return x_paired.reshape(m, k // 8, 2, 4).transpose(2, 3).reshape(m, k)
