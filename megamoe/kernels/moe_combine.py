"""MoE combine: weighted gather-sum of the expert outputs back to token order.

One kernel, one launcher (:func:`launch_moe_combine`).

``out[t, :] = shared[t, :] + sum_j topk_weights[t, j] * expert_out[inv_perm[t*k + j], :]``

evaluated in float32 in a fixed order (shared first, then j = 0..k-1) and rounded
once to bf16. It is a *gather* (each program owns one token row and a block of
columns), so no atomics are used and the result is deterministic. ``inv_perm``
maps the (token, slot) pair index ``t*k + j`` to the row of the expert-sorted
GEMM output; it lives on the device and is never read on the host.

Grid: ``(T, cdiv(H, BLOCK_H))``; ``T = 0`` launches nothing.

An ``inv_perm`` value outside ``[0, R)`` drops its pair (adds nothing, reads nothing) and the program sets
``ERR_FLAG`` in the error word (``megamoe/ops/errors.py``) with one predicated atomic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_flags

# BLOCK_H / num_warps: one program reads k rows of BLOCK_H bf16 (k*BLOCK_H*2 bytes);
# 1024 columns keep the grid >= 4 programs per row at H = 4096 and the loads 16-byte wide.
COMBINE_CONFIG = {"BLOCK_H": 1024, "num_warps": 4}
INTERPRETER_CONFIG = {"BLOCK_H": 64, "num_warps": 1}


@triton.jit
def _round_bf16(v, INTERPRET: tl.constexpr):
    """float32 -> bf16 with round-to-nearest-even also under the interpreter (whose cast truncates)."""
    if INTERPRET:
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) & -65536).to(tl.float32, bitcast=True)
        v = tl.where(v != v, v, rounded)
    return v.to(tl.bfloat16)


@triton.jit
def _moe_combine_kernel(
    expert_out_ptr,  # (R, H) bf16, rows sorted by expert
    inv_perm_ptr,  # (T*k,) int32
    weight_ptr,  # (T, k) fp32
    shared_ptr,  # (T, H) bf16 (read only if HAS_SHARED)
    out_ptr,  # (T, H) bf16
    err_ptr,  # (1,) int32 error word
    H,
    num_expert_rows,  # R
    stride_expert_out,
    stride_shared,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
    ERR_FLAG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * stride_shared + cols, mask=col_mask, other=0.0).to(tl.float32)
    bad = 0
    for j in tl.static_range(TOP_K):
        row = tl.load(inv_perm_ptr + token * TOP_K + j).to(tl.int64)
        if ERR_FLAG != 0:
            ok = (row >= 0) & (row < num_expert_rows)
            bad += (~ok).to(tl.int32)
            w = tl.where(ok, tl.load(weight_ptr + token * TOP_K + j), 0.0)  # a dropped pair adds w=0 * y=0
            y = tl.load(expert_out_ptr + tl.where(ok, row, 0) * stride_expert_out + cols, mask=col_mask & ok,
                        other=0.0)
        else:  # guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only): inv_perm trusted
            w = tl.load(weight_ptr + token * TOP_K + j)
            y = tl.load(expert_out_ptr + row * stride_expert_out + cols, mask=col_mask, other=0.0)
        acc += w * y.to(tl.float32)
    # one flag per token (the column-block-0 program)
    if ERR_FLAG != 0:
        tl.atomic_or(err_ptr, ERR_FLAG, mask=(bad > 0) & (tl.program_id(1) == 0))
    tl.store(out_ptr + token * stride_out + cols, _round_bf16(acc, INTERPRET), mask=col_mask)


def launch_moe_combine(
    expert_out: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None,
    out: torch.Tensor,
    *,
    interpreter: bool = False,
    error_word: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the combine kernel (no validation: the op in megamoe/ops/moe.py does it).

    expert_out: (R >= T*k, H) bf16, unit column stride. inv_perm: (T*k,) int32
    contiguous. topk_weights: (T, k) fp32 contiguous. shared: None or (T, H)
    bf16. out: (T, H) bf16. error_word: the (1,) int32 word an out-of-range
    ``inv_perm`` flags (default: the device's). Returns ``out``.
    """
    from ..ops import errors

    num_tokens, top_k = topk_weights.shape
    hidden = out.shape[1]
    if num_tokens == 0 or hidden == 0:
        return out
    cfg = INTERPRETER_CONFIG if interpreter else COMBINE_CONFIG
    block_h = min(cfg["BLOCK_H"], triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    has_shared = shared is not None
    pdl, launch_pdl = pdl_flags(out, "combine")
    _moe_combine_kernel[grid](
        expert_out,
        inv_perm,
        topk_weights,
        shared if has_shared else out,
        out,
        error_word if error_word is not None else errors.error_word(out.device),
        hidden,
        expert_out.shape[0],
        expert_out.stride(0),
        shared.stride(0) if has_shared else 0,
        out.stride(0),
        TOP_K=top_k,
        HAS_SHARED=has_shared,
        BLOCK_H=block_h,
        INTERPRET=interpreter,
        ERR_FLAG=errors.kernel_flag("combine", "inv_perm"),
        num_warps=cfg["num_warps"],
        PDL=pdl,
        launch_pdl=launch_pdl,
    )
    return out
