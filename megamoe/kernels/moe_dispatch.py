"""MoE dispatch in one launch: stable grouping of the (token, slot) pairs by expert.

One kernel, one launcher (:func:`launch_moe_dispatch`). Same outputs, bit for bit,
as the torch path of ``megamoe.ops.moe.dispatch`` (a stable sort by expert id):

* ``expert_offsets[e]`` (E,) int32 -- cumulative row ends;
* ``sorted_expert[r]`` -- expert of sorted row r; ``row_index[r]`` -- its token;
* ``inv_perm[p]`` -- sorted row of pair ``p = t*k + j``.

A single program sorts the packed keys ``bin * P_PAD + pair`` of all pairs at once (``tl.sort``; P_PAD = the
pair count padded to a power of two, a host shape): position r of the sorted keys is the row of that pair, so the
pairs of one expert keep their pair order (stable), and one ``tl.histogram`` of the bins gives the offsets. This
replaced (2026-11-26) a program that walked the pairs twice in 32-pair chunks (histogram, then ranks), serial in
the chunks: 17 / 33 us for 224 / 448 pairs on the H100 (``benchmarks/bench_dispatch.py`` keeps it as the baseline).
Decode- and small-prefill-sized inputs (up to ``megamoe.ops.moe.DISPATCH_SORT_MAX_PAIRS``); larger ones take the
blocked kernels below (:func:`launch_moe_dispatch_blocked`, same outputs).

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


def dispatch_num_warps(pairs_pad: int) -> int:
    """Warps of the one-program sort for ``pairs_pad`` (power-of-two) pairs."""
    return 4 if pairs_pad <= 1024 else 8


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
    BINS: tl.constexpr,  # power of two > num_groups; bin BINS-1 collects the padding lanes
    P_PAD: tl.constexpr,  # power of two >= num_pairs
    ERR_FLAG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    p = tl.arange(0, P_PAD)
    valid = p < num_pairs
    e = tl.load(ids_ptr + p, mask=valid, other=0)
    if ERR_FLAG != 0:
        bad = valid & ((e < 0) | (e >= num_groups))
        e = tl.where(bad, num_groups, e)  # dropped pairs: pseudo-expert E, after every real expert
        tl.atomic_or(err_ptr, ERR_FLAG, mask=tl.max(bad.to(tl.int32), 0) > 0)
    else:  # guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only): ids trusted
        e = tl.where(valid, e, num_groups)
    e = tl.where(valid, e, BINS - 1)  # padding lanes sort last (after any dropped pair: larger pair index)
    counts = tl.histogram(e, BINS)
    bins = tl.arange(0, BINS)
    tl.store(offsets_ptr + bins, tl.cumsum(counts, 0), mask=bins < num_groups)
    key = tl.sort(e * P_PAD + p)  # stable by expert: the pair index breaks the ties
    pair = key % P_PAD
    tl.store(sorted_expert_ptr + p, key // P_PAD, mask=valid)
    tl.store(row_index_ptr + p, pair // TOP_K, mask=valid)
    tl.store(inv_perm_ptr + pair, p, mask=valid)


def launch_moe_dispatch(ids: torch.Tensor, top_k: int, num_groups: int, offsets: torch.Tensor,
                        sorted_expert: torch.Tensor, row_index: torch.Tensor, inv_perm: torch.Tensor,
                        error_word: torch.Tensor | None = None) -> None:
    """ids: (P,) int32 contiguous (P = T*k, pair order). Outputs: int32 contiguous, (E,) and three (P,).
    error_word: the (1,) int32 word an id outside [0, E) flags (default: the device's)."""
    from ..ops import errors

    num_pairs = ids.shape[0]
    if num_pairs == 0:
        offsets.zero_()
        return
    bins = triton.next_power_of_2(num_groups + 1)
    pairs_pad = triton.next_power_of_2(num_pairs)
    if bins * pairs_pad > 2 ** 31:
        raise ValueError(f"ids: {num_pairs} pairs x {num_groups} groups exceed the kernel's int32 sort keys")
    pdl = pdl_enabled(ids)
    _moe_dispatch_kernel[(1,)](
        ids, offsets, sorted_expert, row_index, inv_perm,
        error_word if error_word is not None else errors.error_word(ids.device), num_pairs, num_groups,
        TOP_K=top_k, BINS=bins, P_PAD=pairs_pad, ERR_FLAG=errors.kernel_flag("dispatch", "topk_ids"),
        num_warps=dispatch_num_warps(pairs_pad), PDL=pdl, launch_pdl=pdl,
    )


# ---------------------------------------------------------------------------------------------------------------
# Blocked dispatch: the same outputs for prefill-sized pair counts, in two launches of many programs.
# Program b owns pairs [b * BLOCK, b * BLOCK + BLOCK). Launch 1 writes each block's histogram of the bins (the
# count matrix (blocks, BINS), int32 workspace). Launch 2: every program sums the matrix's columns (the experts'
# totals -> their first rows) and the rows above its own (its pairs' offset inside each expert), sorts its block's
# keys ``bin * BLOCK + local pair`` (``tl.sort``), and places sorted lane i at
# ``first[e] + above[e] + (i - block_first[e])``: the pairs of one expert keep their pair order across blocks and
# inside a block, i.e. the stable sort by expert, bit for bit. Program 0 writes ``expert_offsets``.
# ---------------------------------------------------------------------------------------------------------------

#: Pairs per program of the blocked dispatch (a power of two; the block's keys are sorted in registers).
DISPATCH_BLOCK = 1024
_COUNT_ROWS = 8  # count-matrix rows summed per step in launch 2


@triton.jit
def _block_bins(ids_ptr, err_ptr, b, num_pairs, num_groups, BINS: tl.constexpr, BLOCK: tl.constexpr,
                ERR_FLAG: tl.constexpr):
    """(bins of block b's pairs, local pair index, valid): ids outside [0, E) -> E (flagged with ERR_FLAG != 0),
    padding lanes -> BINS-1."""
    lp = tl.arange(0, BLOCK)
    p = b * BLOCK + lp
    valid = p < num_pairs
    e = tl.load(ids_ptr + p, mask=valid, other=0)
    bad = valid & ((e < 0) | (e >= num_groups))
    e = tl.where(bad, num_groups, e)  # dropped pairs: pseudo-expert E, after every real expert
    if ERR_FLAG != 0:
        tl.atomic_or(err_ptr, ERR_FLAG, mask=tl.max(bad.to(tl.int32), 0) > 0)
    return tl.where(valid, e, BINS - 1), lp, valid


@triton.jit
def _moe_dispatch_count_kernel(ids_ptr, counts_ptr, err_ptr, num_pairs, num_groups, BINS: tl.constexpr,
                               BLOCK: tl.constexpr, ERR_FLAG: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_prologue(PDL)
    b = tl.program_id(0)
    e, _, _ = _block_bins(ids_ptr, err_ptr, b, num_pairs, num_groups, BINS, BLOCK, ERR_FLAG)
    tl.store(counts_ptr + b * BINS + tl.arange(0, BINS), tl.histogram(e, BINS))


@triton.jit
def _moe_dispatch_place_kernel(ids_ptr, counts_ptr, offsets_ptr, sorted_expert_ptr, row_index_ptr, inv_perm_ptr,
                               num_pairs, num_groups, num_blocks, TOP_K: tl.constexpr, BINS: tl.constexpr,
                               BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_prologue(PDL)
    b = tl.program_id(0)
    bins = tl.arange(0, BINS)
    rows = tl.arange(0, ROWS)
    total = tl.zeros((BINS,), dtype=tl.int32)
    above = tl.zeros((BINS,), dtype=tl.int32)
    r0 = 0
    while r0 < num_blocks:  # column sums of the count matrix, ROWS rows at a time (fixed order: exact integers)
        r = r0 + rows
        tile = tl.load(counts_ptr + r[:, None] * BINS + bins[None, :], mask=(r < num_blocks)[:, None], other=0)
        total += tl.sum(tile, axis=0)
        above += tl.sum(tl.where((r < b)[:, None], tile, 0), axis=0)
        r0 += ROWS
    total = tl.where(bins <= num_groups, total, 0)  # real experts and the dropped pairs' group E; not the padding
    ends = tl.cumsum(total, 0)
    if b == 0:
        tl.store(offsets_ptr + bins, ends, mask=bins < num_groups)
    own = tl.load(counts_ptr + b * BINS + bins)
    base = ends - total + above - (tl.cumsum(own, 0) - own)  # first[e] + above[e] - block_first[e]
    e, lp, _ = _block_bins(ids_ptr, ids_ptr, b, num_pairs, num_groups, BINS, BLOCK, 0)  # launch 1 flagged them
    key = tl.sort(e * BLOCK + lp)  # stable by expert inside the block
    ek = key // BLOCK
    pair = b * BLOCK + key % BLOCK
    dest = tl.gather(base, ek, 0) + lp  # sorted lane lp: its rank in the block is lp - block_first[ek]
    placed = pair < num_pairs
    tl.store(sorted_expert_ptr + dest, ek, mask=placed)
    tl.store(row_index_ptr + dest, pair // TOP_K, mask=placed)
    tl.store(inv_perm_ptr + pair, dest, mask=placed)


def launch_moe_dispatch_blocked(ids: torch.Tensor, top_k: int, num_groups: int, offsets: torch.Tensor,
                                sorted_expert: torch.Tensor, row_index: torch.Tensor, inv_perm: torch.Tensor,
                                error_word: torch.Tensor | None = None, block: int | None = None) -> None:
    """:func:`launch_moe_dispatch`'s contract and outputs for any pair count, in two launches of cdiv(P, ``block``)
    programs (default :data:`DISPATCH_BLOCK`; the comment above); an int32 count workspace of cdiv(P, block) x BINS
    is allocated here (graph capture: from the graph's pool)."""
    from ..ops import errors

    block = DISPATCH_BLOCK if block is None else block
    num_pairs = ids.shape[0]
    if num_pairs == 0:
        offsets.zero_()
        return
    bins = triton.next_power_of_2(num_groups + 2)  # E real groups, the dropped pairs' group E, the padding bin
    if bins * block > 2 ** 31:
        raise ValueError(f"num_groups: {num_groups} groups x {block}-pair blocks exceed the kernel's int32 sort keys")
    num_blocks = triton.cdiv(num_pairs, block)
    counts = torch.empty(num_blocks * bins, dtype=torch.int32, device=ids.device)
    pdl = pdl_enabled(ids)
    warps = dispatch_num_warps(block)
    _moe_dispatch_count_kernel[(num_blocks,)](
        ids, counts, error_word if error_word is not None else errors.error_word(ids.device), num_pairs, num_groups,
        BINS=bins, BLOCK=block, ERR_FLAG=errors.kernel_flag("dispatch", "topk_ids"), num_warps=warps, PDL=pdl,
        launch_pdl=pdl)
    _moe_dispatch_place_kernel[(num_blocks,)](
        ids, counts, offsets, sorted_expert, row_index, inv_perm, num_pairs, num_groups, num_blocks, TOP_K=top_k,
        BINS=bins, BLOCK=block, ROWS=_COUNT_ROWS, num_warps=warps, PDL=pdl, launch_pdl=pdl)
