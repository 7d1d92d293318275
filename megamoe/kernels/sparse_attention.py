"""Sparse FP8 MQA attention of DeepSeek-V4 (decode and prefill) for sm_90: one launcher,
:func:`launch_sparse_mqa_attention`.

Semantics: ``megamoe.reference.attention.sparse_mqa_attention`` (NUMERICS.md ``sparse_attn``): per query
token ``n`` and head ``h``, over the valid window rows ``window_kv[window_idx[n, :]]`` and the valid compressed
entries ``entry_idx[n, :]`` of request slot ``slots[n]`` (paged pool, FP8 nope dims with a float32 scale per
``SB`` elements, bf16 rope dims), ``o = sum_j p_j kv_j / (sum_j p_j + exp(sink_h - m))`` with
``p_j = exp(scale * q_h . kv_j - m)``. Invalid indices are skipped; a query without valid rows gets zeros; a
NaN in q or in a selected row gives NaN (the finalisation zeroes where the softmax denominator ``l`` is 0 only).

Structure
---------
* Main kernel, grid ``(N, cdiv(H, BLOCK_H), num_splits)``: one program owns ALL heads of a head tile of ONE
  query token (MQA: every head reads the same rows, so each row is loaded and dequantized once per tile) and
  a contiguous range of BLOCK_N-row blocks of the token's row list ``[window blocks | entry blocks]``.
  Per block: gather BLOCK_N rows (window rows bf16; entries: FP8 bytes -> float32 * their block scale ->
  bf16, rope dims bf16) into a ``(BLOCK_N, D)`` bf16 tile; ``S = Q K^T`` and ``O += P V`` on the tensor cores
  (bf16 operands, fp32 accumulation, the same tile is K and V); online softmax in the exp2 domain.
  Entry tiles are built as ``(BLOCK_N, D / C, C)`` (C = a power-of-two chunk that divides nope, rope and the
  scale block, 64 for V4) so that each chunk has exactly one scale per row, then reshaped to ``(BLOCK_N, D)``.
* ``num_splits == 1``: the program finalises (sink in the denominator, zeros without valid rows) and stores
  bf16. ``num_splits > 1`` (split-KV, chosen on the host from shapes only, :func:`choose_num_splits`): each
  program stores its partial ``(m, l, acc)`` (m and l in the log2 domain / unnormalised) into a workspace,
  and ``_combine_kernel`` merges the splits of a (token, head block) in the fixed order 0..num_splits-1,
  so the result has the same bits on every run. No atomics, no host syncs: CUDA-graph capturable.

Every device-valued index is masked before it addresses memory: window ids outside ``[0, R)``; entry ids
``< 0``; logical pages ``>= L``; physical pages outside ``[0, P)``; slots outside ``[0, S)``. Masked rows are
loaded as zeros and get score ``-inf`` (p = 0), so a NaN in an unselected entry never reaches a query.
-1 is the legitimate "none" marker of window ids, entry ids, slots and pages; any other out-of-range value is
also flagged in the device error word (``megamoe/ops/errors.py``: window id ``< -1`` or ``>= R``; entry id
``< -1`` or past the table (only for a valid slot); slot ``< -1`` or ``>= S`` (when K > 0); looked-up page ``< -1`` or
``>= P``): each program ORs the codes of its rows per lane in registers and issues one predicated atomic at the
end (no atomic or reduction in the loop).

Register budget (offline sm_90 compile of ``ATTENTION_CONFIG``, ``compile_sm90``; checked in
tests/kernels/test_sparse_attention.py): the ``64 x 512`` fp32 accumulator alone is 128 KB, i.e. 128 registers
per thread at 8 warps (2 warpgroups, each owning 256 of the 512 columns: ``HGMMA.64x256x16`` for P.V), half the
SM's 256 KB register file. A 128-head tile would need the whole register file for the accumulator alone, so
H = 128 (V4-Pro) runs two 64-head tiles (two programs per token reading the same rows, the second mostly from
L2). Measured: 255 registers, 264 B of stack (14 reloads per iteration, no spill stores in the loop; with the
device guard's error code: 280 B, 16 reloads, one store, +40 of ~1430 SASS instructions per iteration), Q and the
K tile in shared memory (128 KB). Triton assigns all 8 warps along M for a dot that feeds another dot, so
both warpgroups compute the whole 64 x BLOCK_N score tile (``HGMMA.64x16x16``, duplicated): the tensor cores do
1.5x the useful MMA work. Two loops (window, entries) instead of one spilled 880 B; BLOCK_N = 16 / 64 measured
200 / 360 B of stack. See benchmarks/NOTES_attention.md.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .gemm.nvfp4_gemm import _num_sms
from .nvfp4_jit import e4m3_decode
from .pdl import grid_dependency_prologue, pdl_flags

# sm_90 tiles. BLOCK_H = 64: the wgmma M of one warpgroup; the 64 x 512 fp32 accumulator at 8 warps is 128
# registers per thread (2 warpgroups split D). BLOCK_N = 32 gathered rows per iteration: the staged K tile is
# 32 registers per thread (BLOCK_N = 64 spilled 360 B, 16 halves the rows per accumulator rescale).
# num_stages = 1: the loop body branches on the row source, which Triton's pipeliner does not stage.
ATTENTION_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}
# Interpreter tiles (CPU tests): the smallest tl.dot tiles, so that tests cover several blocks and head tiles.
INTERPRETER_CONFIG = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
# Combine: (token, 16 heads, 64 columns) per program, so that batch 1 still spreads the workspace reads
# (splits x 64 heads x 512 x 4 B, e.g. 4.7 MB for 36 splits) over 32 programs.
COMBINE_CONFIG = {"BLOCK_H": 16, "BLOCK_D": 64, "num_warps": 4}
INTERPRETER_COMBINE_CONFIG = {"BLOCK_H": 16, "BLOCK_D": 64, "num_warps": 1}
# Split-KV: aim for this many programs (132 SMs of an H100 SXM, one 8-warp program per SM given the
# registers); a fixed constant, not a device query, so the split (and the bits) depend on shapes only.
SPLIT_TARGET_PROGRAMS = 132
# Each split keeps at least this many BLOCK_N blocks (the workspace round trip costs a block's worth).
MIN_BLOCKS_PER_SPLIT = 1
MAX_SPLITS = 64

LOG2E = 1.4426950408889634

# Main-kernel implementation, ``MEGAMOE_ATTN_IMPL`` (read at every launch) or the launcher's ``impl``:
# * "v1": this file, plain Triton (also the interpreter's kernel);
# * "ws": ``sparse_attention_ws.py``, Gluon with a warp-specialized shared-memory pipeline (v2; 1.3-2.0x v1 at
#   batch 32 / 128, gpu_check_v8/attention_v2.md); sm_90 and D = 512 only, else v1;
# * "ws3" (the default): ``sparse_attention_ws3.py``, three warpgroups with separate roles and 64-row blocks (v3);
#   V4's row only (448 FP8 + 64 rope dims, 64-element scale blocks), else "ws". Validated on the H100 and faster
#   than v2 at every measured batch 1-128 and context 32k / 128k (benchmarks/results/attn_v3).
IMPLS = ("v1", "ws", "ws3")
# (nope, rope, scale block) of the rows v3 takes: V4's.
V3_ROW = (448, 64, 64)


def default_impl() -> str:
    """The launcher's main kernel when ``impl`` is not given: ``MEGAMOE_ATTN_IMPL`` or "ws3"."""
    impl = os.environ.get("MEGAMOE_ATTN_IMPL", "ws3")
    if impl not in IMPLS:
        raise ValueError(f"MEGAMOE_ATTN_IMPL: expected one of {IMPLS}, got {impl!r}")
    return impl


def main_block_n(impl: str | None = None, *, interpreter: bool = False, head_dim: int = 512, rope_dim: int = 64,
                 scale_block: int = 64) -> int:
    """Rows per block of the main kernel that ``impl`` (None: :func:`default_impl`) runs on an sm_90 GPU for rows
    of ``head_dim`` with ``rope_dim`` bf16 dims and FP8 scale blocks of ``scale_block`` (the interpreter:
    ``INTERPRETER_CONFIG``'s): the block of the bf16-P rounding and of the split layout. v3 ("ws3") takes V4's
    row only (``sparse_attention_ws3.supports``); other rows run v2 / v1 with ``ATTENTION_CONFIG``'s block."""
    if interpreter:
        return INTERPRETER_CONFIG["BLOCK_N"]
    if (default_impl() if impl is None else impl) == "ws3" and \
            (head_dim - rope_dim, rope_dim, scale_block) == V3_ROW:
        from .sparse_attention_ws3 import WS3_CONFIG

        return WS3_CONFIG["BLOCK_N"]
    return ATTENTION_CONFIG["BLOCK_N"]


def chunk_width(nope: int, rope: int, scale_block: int) -> int:
    """The entry tile's chunk: the largest power of two <= 64 dividing nope, rope (if > 0) and the scale block."""
    g = math.gcd(nope, scale_block)
    if rope:
        g = math.gcd(g, rope)
    c = 64
    while g % c:
        c //= 2
    return c


def choose_num_splits(num_tokens: int, num_heads: int, window: int, topk: int, *, interpreter: bool = False,
                      block_n: int | None = None) -> tuple[int, int]:
    """(num_splits, blocks_per_split) from shapes only: split the row list when the grid is too small.

    One 8-warp program fits per SM (registers), so the split count is ``floor(SPLIT_TARGET_PROGRAMS /
    programs)``: the grid stays within one wave (a second, partial wave would cost a whole program's time).
    ``block_n``: the main kernel's rows per block (None: ``ATTENTION_CONFIG``'s, or the interpreter's). A larger
    block never gives more splits, so a workspace sized with the default fits every kernel.
    """
    cfg = INTERPRETER_CONFIG if interpreter else ATTENTION_CONFIG
    block_n = cfg["BLOCK_N"] if block_n is None else block_n
    blocks = triton.cdiv(window, block_n) + triton.cdiv(topk, block_n)
    programs = num_tokens * triton.cdiv(num_heads, cfg["BLOCK_H"])
    want = min(SPLIT_TARGET_PROGRAMS // max(programs, 1), blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    return split_layout(blocks, max(want, 1))


def split_layout(blocks: int, num_splits: int) -> tuple[int, int]:
    """(splits, blocks_per_split) for a requested split count: every split non-empty (when blocks > 0)."""
    num_splits = max(1, min(num_splits, max(blocks, 1)))
    per = max(triton.cdiv(blocks, num_splits), 1)
    return triton.cdiv(max(blocks, 1), per), per


@triton.jit
def _round_bf16(v, INTERPRET: tl.constexpr):
    """float32 -> bf16, round to nearest even also under the interpreter (whose cast truncates)."""
    if INTERPRET:
        bits = v.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        v = tl.where(v != v, v, rounded)
    return v.to(tl.bfloat16)


@triton.jit
def _attend_block(q, kv, valid, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr):
    """One online-softmax step over a (BLOCK_N, D) bf16 tile; scores in the log2 domain; P rounded to bf16."""
    if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 values are exact in fp32
        s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if INTERPRET:
        pv = tl.dot(_round_bf16(p, True).to(tl.float32), kv.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(tl.bfloat16), kv)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _window_tile(win_kv_ptr, win_idx_ptr, n, b, W, R, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                 FLAG_WINDOW: tl.constexpr):
    """Window block b of query n: ((BLOCK_N, D_P2) bf16 rows, (BLOCK_N,) valid, (BLOCK_N,) int32 error code);
    invalid rows are zeros; an id < -1 or >= R gets FLAG_WINDOW in its code."""
    jj = b * BLOCK_N + tl.arange(0, BLOCK_N)
    rid = tl.load(win_idx_ptr + n * W + jj, mask=jj < W, other=-1)
    valid = (rid >= 0) & (rid < R)
    row = tl.where(valid, rid, 0).to(tl.int64)
    d = tl.arange(0, D_P2)
    kv = tl.load(win_kv_ptr + row[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    code = 0
    if FLAG_WINDOW != 0:
        code = ((rid < -1) | (rid >= R)).to(tl.int32) * FLAG_WINDOW  # -1 (none) is not an error
    return kv, valid, code


@triton.jit
def _entry_tile(fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, n, b, K, P, L, slot64, slot_ok,
                NOPE: tl.constexpr, ROPE: tl.constexpr, EPB: tl.constexpr, NSC: tl.constexpr, SB: tl.constexpr,
                C: tl.constexpr, NC_P2: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                INTERPRET: tl.constexpr, FLAG_ENTRY: tl.constexpr, FLAG_TABLE: tl.constexpr):
    """Entry block b of query n, dequantized: ((BLOCK_N, NC_P2 * C) bf16 rows, (BLOCK_N,) valid, (BLOCK_N,) int32
    error code).

    Built as (BLOCK_N, NC_P2, C) chunks: chunk c < NOPE / C is FP8 * its row's scale of block c * C // SB,
    rounded to bf16; the next ROPE / C chunks are the bf16 rope dims; padding chunks and invalid rows are zeros.
    """
    NCN: tl.constexpr = NOPE // C
    NCD: tl.constexpr = D // C
    jj = b * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(ent_idx_ptr + n * K + jj, mask=jj < K, other=-1)
    logical = tl.where(e >= 0, e // EPB, 0)
    page = tl.load(table_ptr + slot64 * L + logical, mask=(e >= 0) & (logical < L) & slot_ok, other=-1)
    valid = (e >= 0) & (page >= 0) & (page < P)
    # errors (-1 = none is not one): an id < -1 or past the table (entries of a bad slot: only the slot's flag);
    # a looked-up page id < -1 or >= P
    err_code = 0
    if FLAG_ENTRY != 0:
        err_code = (slot_ok & ((e < -1) | ((e >= 0) & (logical >= L)))).to(tl.int32) * FLAG_ENTRY | \
            ((page < -1) | (page >= P)).to(tl.int32) * FLAG_TABLE
    row = tl.where(valid, page.to(tl.int64) * EPB + tl.where(e >= 0, e % EPB, 0), 0)
    row3 = row[:, None, None]
    v3 = valid[:, None, None]
    c3 = tl.arange(0, NC_P2)[None, :, None]
    x3 = tl.arange(0, C)[None, None, :]
    nmask = v3 & (c3 < NCN)
    code = tl.load(fp8_ptr + row3 * NOPE + c3 * C + x3, mask=nmask, other=0)
    blk_scale = tl.load(scale_ptr + row3 * NSC + (c3 * C) // SB, mask=nmask, other=0.0)
    if INTERPRET:
        value = e4m3_decode(code)  # the interpreter's fp8 cast reads 0x7F as 480, not NaN
    else:
        value = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    nope = _round_bf16(value * blk_scale, INTERPRET)
    rmask = v3 & (c3 >= NCN) & (c3 < NCD)
    rope = tl.load(rope_ptr + row3 * ROPE + (c3 - NCN) * C + x3, mask=rmask, other=0.0)
    kv = tl.reshape(tl.where(c3 < NCN, nope, rope), (BLOCK_N, NC_P2 * C))
    return kv, valid, err_code


@triton.jit
def _sparse_mqa_kernel(
    q_ptr,            # (N, H, D) bf16
    sink_ptr,         # (H,) float32
    win_kv_ptr,       # (R, D) bf16
    win_idx_ptr,      # (N, W) int32
    fp8_ptr,          # (P * EPB, NOPE) uint8 view of float8_e4m3fn
    scale_ptr,        # (P * EPB, NSC) float32
    rope_ptr,         # (P * EPB, ROPE) bf16
    table_ptr,        # (S, L) int32
    slots_ptr,        # (N,) int32
    ent_idx_ptr,      # (N, K) int32
    out_ptr,          # (N, H, D) bf16 (SPLIT == False)
    ws_acc_ptr,       # (N, NUM_SPLITS, H, D) float32 (SPLIT)
    ws_ml_ptr,        # (N, NUM_SPLITS, 2, H) float32 (SPLIT): m, l in the log2 domain
    err_ptr,          # (1,) int32 error word (megamoe/ops/errors.py)
    H, R, W, K, P, S, L, blocks_per_split, num_splits,
    qk_scale,         # softmax_scale * log2(e)
    D: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, EPB: tl.constexpr, NSC: tl.constexpr,
    SB: tl.constexpr, C: tl.constexpr, NC_P2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    FLAG_WINDOW: tl.constexpr, FLAG_ENTRY: tl.constexpr, FLAG_SLOTS: tl.constexpr, FLAG_TABLE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    n = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2)
    D_P2: tl.constexpr = NC_P2 * C

    h = head0 + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, D_P2)
    dmask = d < D
    q = tl.load(q_ptr + (n * H + h[:, None]) * D + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_P2), tl.float32)

    num_wb = tl.cdiv(W, BLOCK_N)
    num_blocks = num_wb + tl.cdiv(K, BLOCK_N)
    lo = split * blocks_per_split
    hi = tl.minimum(lo + blocks_per_split, num_blocks)

    slot = tl.load(slots_ptr + n)
    slot_ok = (slot >= 0) & (slot < S)
    slot64 = tl.where(slot_ok, slot, 0).to(tl.int64)
    # error bits of the indices this program read, OR-ed per lane (no reduction, no atomic in the loop); one
    # predicated atomic after it. A slot < -1 or >= S is flagged when the query has entry ids to look up (K > 0;
    # window-only layers pass a dummy table); -1 = none is not an error.
    # (all FLAG_* are 0 when the device guard is compiled out, MEGAMOE_DEVICE_GUARD=0: no flag code at all)
    GUARD: tl.constexpr = FLAG_SLOTS != 0
    err = tl.zeros((BLOCK_N,), tl.int32) + ((K > 0) & ((slot < -1) | (slot >= S))).to(tl.int32) * FLAG_SLOTS
    # One loop over blocks [lo, hi) of the row list [window blocks | entry blocks], the tile source chosen per
    # block (two loops, one per source, kept both sets of hoisted addresses live and spilled ~880 B/thread).
    if INTERPRET:
        # The interpreter cannot take a tensor as a range() bound (numpy >= 2): a while loop instead.
        b = lo
        while b < hi:
            if b < num_wb:
                kv, valid, code = _window_tile(win_kv_ptr, win_idx_ptr, n, b, W, R, D, D_P2, BLOCK_N, FLAG_WINDOW)
            else:
                kv, valid, code = _entry_tile(fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, n, b - num_wb,
                                              K, P, L, slot64, slot_ok, NOPE, ROPE, EPB, NSC, SB, C, NC_P2, D,
                                              BLOCK_N, INTERPRET, FLAG_ENTRY, FLAG_TABLE)
            if GUARD:
                err = err | code
            m_i, l_i, acc = _attend_block(q, kv, valid, m_i, l_i, acc, qk_scale, INTERPRET)
            b += 1
    else:
        for b in range(lo, hi):
            if b < num_wb:
                kv, valid, code = _window_tile(win_kv_ptr, win_idx_ptr, n, b, W, R, D, D_P2, BLOCK_N, FLAG_WINDOW)
            else:
                kv, valid, code = _entry_tile(fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, n, b - num_wb,
                                              K, P, L, slot64, slot_ok, NOPE, ROPE, EPB, NSC, SB, C, NC_P2, D,
                                              BLOCK_N, INTERPRET, FLAG_ENTRY, FLAG_TABLE)
            if GUARD:
                err = err | code
            m_i, l_i, acc = _attend_block(q, kv, valid, m_i, l_i, acc, qk_scale, INTERPRET)

    if GUARD:
        tl.atomic_or(err_ptr + tl.zeros((BLOCK_N,), tl.int32), err, mask=err != 0)

    if SPLIT:
        base = n * num_splits + split
        tl.store(ws_acc_ptr + (base * H + h[:, None]) * D + d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
        tl.store(ws_ml_ptr + base * 2 * H + h, m_i, mask=hmask)
        tl.store(ws_ml_ptr + base * 2 * H + H + h, l_i, mask=hmask)
    else:
        sink = tl.load(sink_ptr + h, mask=hmask, other=0.0) * 1.4426950408889634
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        o = acc / (l_i + tl.math.exp2(sink - m_use))[:, None]
        # zeros only without a valid row, i.e. l == 0 (once m is finite the row at the max adds 2^0 = 1 to l, so
        # l >= 1; while m == -inf l is 0, or NaN after a NaN score, which max ignores): NaN in, NaN out
        o = tl.where((l_i == 0.0)[:, None], 0.0, o)
        tl.store(out_ptr + (n * H + h[:, None]) * D + d[None, :], _round_bf16(o, INTERPRET),
                 mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _combine_kernel(
    sink_ptr, ws_acc_ptr, ws_ml_ptr, out_ptr, H,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the splits of one (token, head block, column block) in the fixed order 0..NUM_SPLITS-1."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask2 = hmask[:, None] & (d < D)[None, :]
    m_all = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(ws_ml_ptr + (n * NUM_SPLITS + s) * 2 * H + h, mask=hmask, other=float("-inf"))
        m_all = tl.maximum(m_all, m_s)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        base = n * NUM_SPLITS + s
        m_s = tl.load(ws_ml_ptr + base * 2 * H + h, mask=hmask, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + base * 2 * H + H + h, mask=hmask, other=0.0)
        w = tl.math.exp2(m_s - m_use)
        l_all += w * l_s
        a_s = tl.load(ws_acc_ptr + (base * H + h[:, None]) * D + d[None, :], mask=mask2, other=0.0)
        acc += w[:, None] * a_s
    sink = tl.load(sink_ptr + h, mask=hmask, other=0.0) * 1.4426950408889634
    o = acc / (l_all + tl.math.exp2(sink - m_use))[:, None]
    # zeros only without a valid row in any split, i.e. l_all == 0 (as the main kernel: the split at the max has
    # weight 1 and l >= 1): a split with NaN scores has l = NaN (its m may be -inf) and 0 * NaN keeps l_all NaN;
    # an empty split (m = -inf, l = 0, acc = 0) adds 0
    o = tl.where((l_all == 0.0)[:, None], 0.0, o)
    tl.store(out_ptr + (n * H + h[:, None]) * D + d[None, :], _round_bf16(o, INTERPRET), mask=mask2)


def error_flags() -> dict:
    """The kernel's constexpr flag bits (``megamoe/ops/errors.py``; all 0 when the guard is compiled out)."""
    from ..ops import errors

    return dict(FLAG_WINDOW=errors.kernel_flag("sparse_attention", "window_idx"),
                FLAG_ENTRY=errors.kernel_flag("sparse_attention", "entry_idx"),
                FLAG_SLOTS=errors.kernel_flag("sparse_attention", "slots"),
                FLAG_TABLE=errors.kernel_flag("sparse_attention", "block_table"))


def workspace_shapes(num_tokens: int, num_heads: int, head_dim: int, num_splits: int):
    """Shapes of the split-KV workspace: acc (N, splits, H, D) float32 and (m, l) (N, splits, 2, H) float32."""
    return (num_tokens, num_splits, num_heads, head_dim), (num_tokens, num_splits, 2, num_heads)


def launch_sparse_mqa_attention(q, attn_sink, softmax_scale: float, window_kv, window_idx, entries_fp8, entries_scale,
                                entries_rope, block_table, slots, entry_idx, out, *, num_splits: int | None = None,
                                workspace=None, interpreter: bool = False, error_word=None, impl: str | None = None):
    """Launch the attention (no validation: ``megamoe.ops.attention`` does it). Returns ``out``.

    q (N, H, D) bf16; attn_sink (H,) float32; window_kv (R, D) bf16; window_idx (N, W) int32;
    entries_fp8 (P, EPB, nope) float8_e4m3fn; entries_scale (P, EPB, nope // SB) float32; entries_rope
    (P, EPB, rope) bf16; block_table (S, L) int32; slots (N,) int32; entry_idx (N, K) int32; out (N, H, D)
    bf16; all contiguous on one device. ``num_splits``: None = :func:`choose_num_splits`; ``workspace``:
    optional ``(acc, ml)`` float32 tensors with at least :func:`workspace_shapes` elements (reused across
    calls / graph replays; allocated here when missing and a split is used). ``error_word``: the (1,) int32 word
    the out-of-range indices flag (default: the device's, ``megamoe.ops.errors``). ``impl``: "v1", "ws" or "ws3"
    (None: :func:`default_impl`); "ws3" runs v3 where ``sparse_attention_ws3.supports`` (V4's row on sm_90), "ws"
    runs v2 where ``sparse_attention_ws.supports`` (sm_90, D = 512), else v1. All use the same workspace and
    combine kernel; the blocks and the split layout are counted in the running kernel's rows per block
    (:func:`main_block_n`).
    """
    from ..ops import errors

    N, H, D = q.shape
    if N == 0 or H == 0:
        return out
    W, K = window_idx.shape[1], entry_idx.shape[1]
    P, EPB, nope = entries_fp8.shape
    rope = entries_rope.shape[-1]
    nsc = entries_scale.shape[-1]
    sb = nope // nsc
    cfg = INTERPRETER_CONFIG if interpreter else ATTENTION_CONFIG
    combine_cfg = INTERPRETER_COMBINE_CONFIG if interpreter else COMBINE_CONFIG
    impl = default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    kernel = "v1"  # the main kernel that runs: "ws3" / "ws" where supported, else v1
    if impl in ("ws", "ws3") and not interpreter:
        from . import sparse_attention_ws, sparse_attention_ws3

        if impl == "ws3" and sparse_attention_ws3.supports(q, D, nope, rope, sb):
            kernel = "ws3"
        elif sparse_attention_ws.supports(q, D, nope, rope, sb):
            kernel = "ws"
    block_n = sparse_attention_ws3.WS3_CONFIG["BLOCK_N"] if kernel == "ws3" else cfg["BLOCK_N"]
    blocks = triton.cdiv(W, block_n) + triton.cdiv(K, block_n)
    if num_splits is None:
        splits, per = choose_num_splits(N, H, W, K, interpreter=interpreter, block_n=block_n)
    else:
        splits, per = split_layout(blocks, num_splits)
    c = chunk_width(nope, rope, sb)
    nc_p2 = triton.next_power_of_2(D // c)
    split = splits > 1
    if split:
        acc_shape, ml_shape = workspace_shapes(N, H, D, splits)
        if workspace is None or workspace[0].numel() < math.prod(acc_shape) or \
                workspace[1].numel() < math.prod(ml_shape):
            workspace = (torch.empty(acc_shape, dtype=torch.float32, device=q.device),
                         torch.empty(ml_shape, dtype=torch.float32, device=q.device))
        ws_acc, ws_ml = workspace
    else:
        ws_acc = ws_ml = attn_sink  # never touched
    word = error_word if error_word is not None else errors.error_word(q.device)
    grid = (N, triton.cdiv(H, cfg["BLOCK_H"]), splits)
    # PDL per kernel name (kernels/pdl.py): the main kernel early only as one wave of its one-program-per-SM grid
    one_wave = q.is_cuda and math.prod(grid) <= _num_sms(q.device.index or 0)
    pdl, launch_pdl = pdl_flags(q, "attention", single_pass=one_wave)
    if kernel == "ws3":
        sparse_attention_ws3.launch_ws3(q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale,
                                        entries_rope, block_table, slots, entry_idx, out, splits=splits, per=per,
                                        ws_acc=ws_acc, ws_ml=ws_ml, error_word=word, pdl=pdl,
                                        launch_pdl=launch_pdl)
    elif kernel == "ws":
        sparse_attention_ws.launch_ws(q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale,
                                      entries_rope, block_table, slots, entry_idx, out, splits=splits, per=per,
                                      ws_acc=ws_acc, ws_ml=ws_ml, error_word=word, pdl=pdl,
                                      launch_pdl=launch_pdl)
    else:
        _launch_v1(grid, q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale,
                   entries_rope, block_table, slots, entry_idx, out, ws_acc, ws_ml, word, splits, per, split, c,
                   nc_p2, cfg, interpreter, pdl, launch_pdl)
    if split:
        pdl, launch_pdl = pdl_flags(q, "attention_combine")
        bd = min(combine_cfg["BLOCK_D"], triton.next_power_of_2(D))
        _combine_kernel[(N, triton.cdiv(H, combine_cfg["BLOCK_H"]), triton.cdiv(D, bd))](
            attn_sink, ws_acc, ws_ml, out, H,
            NUM_SPLITS=splits, D=D, BLOCK_H=combine_cfg["BLOCK_H"], BLOCK_D=bd, INTERPRET=interpreter,
            num_warps=combine_cfg["num_warps"], PDL=pdl, launch_pdl=launch_pdl,
        )
    return out


def _launch_v1(grid, q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
               block_table, slots, entry_idx, out, ws_acc, ws_ml, word, splits, per, split, c, nc_p2, cfg,
               interpreter, pdl, launch_pdl):
    N, H, D = q.shape
    W, K = window_idx.shape[1], entry_idx.shape[1]
    P, EPB, nope = entries_fp8.shape
    rope = entries_rope.shape[-1]
    nsc = entries_scale.shape[-1]
    sb = nope // nsc
    _sparse_mqa_kernel[grid](
        q, attn_sink, window_kv, window_idx, entries_fp8.view(torch.uint8), entries_scale, entries_rope,
        block_table, slots, entry_idx, out, ws_acc, ws_ml, word,
        H, window_kv.shape[0], W, K, P, block_table.shape[0], block_table.shape[1], per, splits,
        float(softmax_scale) * LOG2E,
        D=D, NOPE=nope, ROPE=rope, EPB=EPB, NSC=nsc, SB=sb, C=c, NC_P2=nc_p2,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, INTERPRET=interpreter,
        **error_flags(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PDL=pdl,
        launch_pdl=launch_pdl,
    )


_MAIN_POINTERS = dict(q_ptr="*bf16", sink_ptr="*fp32", win_kv_ptr="*bf16", win_idx_ptr="*i32", fp8_ptr="*u8",
                      scale_ptr="*fp32", rope_ptr="*bf16", table_ptr="*i32", slots_ptr="*i32", ent_idx_ptr="*i32",
                      out_ptr="*bf16", ws_acc_ptr="*fp32", ws_ml_ptr="*fp32", err_ptr="*i32")
_MAIN_SCALARS = ("H", "R", "W", "K", "P", "S", "L", "blocks_per_split", "num_splits")


def compile_sm90(*, head_dim: int = 512, rope_dim: int = 64, scale_block: int = 64, entries_per_block: int = 64,
                 split: bool = False, config: dict | None = None, pdl: bool = False):
    """Compile the main kernel for sm_90 without a GPU (tests / offline register and spill counts).

    Pointers are specialised 16-byte aligned as a launch on fresh torch tensors would be; the returned
    ``CompiledKernel`` has ``n_regs``, ``n_spills``, ``metadata.shared`` and ``asm["ptx"]``. ``pdl``: the
    programmatic-dependent-launch build (``megamoe.kernels.pdl``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = dict(ATTENTION_CONFIG, **(config or {}))
    nope = head_dim - rope_dim
    c = chunk_width(nope, rope_dim, scale_block)
    constants = dict(D=head_dim, NOPE=nope, ROPE=rope_dim, EPB=entries_per_block, NSC=nope // scale_block,
                     SB=scale_block, C=c, NC_P2=triton.next_power_of_2(head_dim // c), BLOCK_H=cfg["BLOCK_H"],
                     BLOCK_N=cfg["BLOCK_N"], SPLIT=split, INTERPRET=False, PDL=pdl, **error_flags())
    signature = dict(_MAIN_POINTERS, **{name: "i32" for name in _MAIN_SCALARS}, qk_scale="fp32",
                     **{name: "constexpr" for name in constants})
    kernel = _sparse_mqa_kernel
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in _MAIN_POINTERS
             if name != "err_ptr"}
    source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "launch_pdl": pdl})
