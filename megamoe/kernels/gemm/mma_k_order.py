"""The MMA K order of the activations (``megamoe.format.mma_order``) as one Triton copy kernel.

One kernel, one launcher (:func:`launch_to_mma_k_order`); the pure-PyTorch definition and reference is
``megamoe.format.mma_order.to_mma_k_order`` (an ``index_select``, which measured ~2x the copy's HBM time:
58 / 151 us for the V4-Flash gate_up / down inputs at 4096 tokens, NOTES_gemm.md v16). Each program copies a
(BLOCK_R rows, one K group) tile with contiguous loads and stores; the permutation is a reshape / permute of the
tile in registers (the compiler's layout conversion through shared memory). The first version loaded one 2-byte
element per address (gathered within the group) and ran at ~1/3 of the HBM rate on the H100 (293 us for the two
V4-Flash 4096-token copies, gpu_check_v23/probe_dispatch_cost.md). Exact (a permutation), any 2-byte dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...format.mma_order import MMA_K_GROUP

BLOCK_ROWS = 64  # rows per program (x one K group of 128 / 256 bf16: 16 / 32 KB)


@triton.jit
def _to_mma_k_order_kernel(x_ptr, out_ptr, num_rows, stride_xm, stride_om, BLOCK_R: tl.constexpr,
                           GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    mask = (rows < num_rows)[:, None]
    r = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r * stride_xm + cols[None, :], mask=mask)
    # memory m = (GROUP / 4) q + 8 i + 4 c1 + 2 c0 + nib  ->  MMA position kappa = c0 + 2q + 8 c1 + 16 nib + 32 i
    v = v.reshape(BLOCK_R, 4, GROUP // 32, 2, 2, 2)  # r, q, i, c1, c0, nib
    v = tl.permute(v, (0, 2, 5, 3, 1, 4)).reshape(BLOCK_R, GROUP)  # r, i, nib, c1, q, c0
    tl.store(out_ptr + r * stride_om + cols[None, :], v, mask=mask)


def launch_to_mma_k_order(x: torch.Tensor, out: torch.Tensor | None = None, block_k: int = MMA_K_GROUP,
                          interpreter: bool = False) -> torch.Tensor:
    """(M, K) 2-byte activations with unit column stride -> (M, K) contiguous in the MMA K order of ``block_k``
    (128 or 256) groups; ``out`` optional (M, K) buffer with unit column stride. Same bits as
    ``megamoe.format.mma_order.to_mma_k_order``. ``interpreter``: run on CPU tensors (Triton interpreter)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.element_size() != 2 or x.stride(-1) != 1:
        raise TypeError(f"x: expected a 2-D 2-byte tensor with unit column stride, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if block_k not in (128, 256):
        raise ValueError(f"block_k: expected 128 or 256, got {block_k!r}")
    m, k = x.shape
    if k % block_k:
        raise ValueError(f"x: K={k} must be a multiple of {block_k} for the MMA K order")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out: expected {tuple(x.shape)} {x.dtype} with unit column stride")
    if m == 0 or k == 0:
        return out
    if x.is_cuda == interpreter:
        raise ValueError("interpreter: True for CPU tensors (Triton interpreter), False for CUDA tensors")
    _to_mma_k_order_kernel[(triton.cdiv(m, BLOCK_ROWS), k // block_k)](
        x, out, m, x.stride(0), out.stride(0), BLOCK_R=BLOCK_ROWS, GROUP=block_k, num_warps=8)
    return out
