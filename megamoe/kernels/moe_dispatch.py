"""MoE dispatch in one launch: stable grouping of the (token, slot) pairs by expert.

One kernel, one launcher (:func:`launch_moe_dispatch`). Same outputs, bit for bit,
as the torch path of ``megamoe.ops.moe.dispatch`` (a stable sort by expert id):

* ``expert_offsets[e]`` (E,) int32 -- cumulative row ends;
* ``sorted_expert[r]`` -- expert of sorted row r; ``row_index[r]`` -- its token;
* ``inv_perm[p]`` -- sorted row of pair ``p = t*k + j``.

A single program walks the pairs twice in chunks of BLOCK: pass 1 builds the
per-expert histogram (``tl.histogram``) and its prefix sum; pass 2 gives each
pair the next free row of its expert (running start + its rank among the
earlier pairs of the chunk with the same expert), which keeps pairs of one expert
in pair order (stable). Decode-sized inputs (tens to hundreds of pairs) finish in
one or a few chunk steps, replacing the multi-kernel radix sort + searchsorted +
scatter of the torch path; large prefill batches should keep the torch path
(the single program is serial over chunks).

An id outside [0, E) drops its pair: it is grouped as expert E (after every real expert, i.e. into the
padding rows past ``expert_offsets[E-1]`` that the grouped GEMM writes as zeros; ``sorted_expert`` holds E
there) and the program sets ``ERR_FLAG`` in the error word (``megamoe/ops/errors.py``) once. Pairs beyond
``num_pairs`` are masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_enabled

DISPATCH_CONFIG = {"BLOCK": 32, "num_warps": 4}


@triton.jit
def _moe_dispatch_kernel(
    ids_ptr,  # (P,) int32 expert id of pair p
    offsets_ptr,  # (E,) int32 out
    sorted_expert_ptr,  # (P,) int32 out
    row_index_ptr,  # (P,) int32 out
    inv_perm_ptr,  # (P,) int32 out
    err_ptr,  # (1,) int32 error word
    num_pairs,
    num_groups,
    TOP_K: tl.constexpr,
    BINS: tl.constexpr,  # power of two > num_groups; bin BINS-1 collects masked lanes
    BLOCK: tl.constexpr,
    ERR_FLAG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    bad = 0
    start = 0
    while start < num_pairs:
        p = start + lanes
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=BINS - 1)
        if ERR_FLAG != 0:
            ok = (e >= 0) & (e < num_groups)
            bad += tl.sum(((p < num_pairs) & ~ok).to(tl.int32), 0)
            e = tl.where(ok, e, num_groups)
        else:  # guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only): ids trusted
            e = tl.where(p < num_pairs, e, num_groups)
        counts += tl.histogram(e, BINS)
        start += BLOCK
    if ERR_FLAG != 0:
        tl.atomic_or(err_ptr, ERR_FLAG, mask=bad > 0)
    counts = tl.where(bins < num_groups, counts, 0)
    ends = tl.cumsum(counts, 0)
    tl.store(offsets_ptr + bins, ends, mask=bins < num_groups)
    running = ends - counts  # next free sorted row of each expert
    start = 0
    while start < num_pairs:
        p = start + lanes
        valid = p < num_pairs
        e = tl.load(ids_ptr + p, mask=valid, other=BINS - 1)
        if ERR_FLAG != 0:
            e = tl.where((e >= 0) & (e < num_groups), e, num_groups)  # dropped pairs: pseudo-expert E
        else:
            e = tl.where(valid, e, num_groups)
        earlier_same = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        base = tl.sum(tl.where(e[:, None] == bins[None, :], running[None, :], 0), axis=1)
        row = base + rank
        tl.store(inv_perm_ptr + p, row, mask=valid)
        tl.store(sorted_expert_ptr + row, e, mask=valid)
        tl.store(row_index_ptr + row, p // TOP_K, mask=valid)
        running += tl.histogram(e, BINS)
        start += BLOCK


def launch_moe_dispatch(ids: torch.Tensor, top_k: int, num_groups: int, offsets: torch.Tensor,
                        sorted_expert: torch.Tensor, row_index: torch.Tensor, inv_perm: torch.Tensor,
                        error_word: torch.Tensor | None = None) -> None:
    """ids: (P,) int32 contiguous (P = T*k, pair order). Outputs: int32 contiguous, (E,) and three (P,).
    error_word: the (1,) int32 word an id outside [0, E) flags (default: the device's)."""
    from ..ops import errors

    num_pairs = ids.shape[0]
    bins = triton.next_power_of_2(num_groups + 1)
    pdl = pdl_enabled(ids)
    _moe_dispatch_kernel[(1,)](
        ids, offsets, sorted_expert, row_index, inv_perm,
        error_word if error_word is not None else errors.error_word(ids.device), num_pairs, num_groups,
        TOP_K=top_k, BINS=bins, BLOCK=DISPATCH_CONFIG["BLOCK"], ERR_FLAG=errors.kernel_flag("dispatch", "topk_ids"),
        num_warps=DISPATCH_CONFIG["num_warps"], PDL=pdl, launch_pdl=pdl,
    )
