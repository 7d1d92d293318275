"""Sparse FP8 MQA attention of DeepSeek-V4, v3: three warpgroups with separate roles (Gluon, sm_90).

Same semantics, arguments, error bits and workspace as v1 / v2 (``sparse_attention.py``,
``sparse_attention_ws.py``): per query token, the row list ``[window blocks | entry blocks]``, every split
from ``m = -inf``, ``num_splits > 1`` ending in v1's ``_combine_kernel`` (fixed split order); per block
``s = (Q K^T) * scale * log2(e)`` (invalid rows ``-inf``), ``p = exp2(s - m_new)`` summed in float32,
``O = O * alpha + bf16(p) V``; FP8 -> float32 * block scale -> bf16 (RNE). The one difference from v1 / v2 is
the block: ``BLOCK_N = 64`` rows (``WS3_CONFIG``), so the bf16 rounding of P is against the running max of
64-row blocks (the reference mirrors it with ``p_rounding=(64, splits)``) and the split layout is counted in
64-row blocks (``launch_sparse_mqa_attention`` does both).

Why (benchmarks/NOTES_attention.md, "v3"): v2 splits the score tile by rows over two consumer warpgroups
(``m64n16k16`` wgmmas re-reading Q from shared memory per 16 rows, row max / sum exchanged twice per 32-row
block) and stages the FP8 bytes through shared memory with a 2-block-deep cp.async ring; it ran at 36% of the
byte floor. v3 gives each warpgroup one role, as DeepSeek's FlashMLA sparse FP8 decode kernel does on Hopper:

* **score warpgroup** (default partition, 4 warps): ``S = Q K^T`` for the whole ``64 x 64`` tile
  (``m64n64k16``, Q and K from shared memory), the online softmax, P (bf16) and the rescale factor to shared
  memory for the other warpgroup, then ``O[:, :256] += P V[:, :256]`` with P from registers.
* **value warpgroup** (worker, 4 warps): waits for P, rescales and accumulates ``O[:, 256:]`` with P from
  shared memory.
* **producer** (worker, 4 warps): gathers a block's rows, software-pipelined in half blocks (see
  ``_producer_partition``). FP8 bytes and their scales go through registers (16-byte loads of int32 words, one
  half's loads in flight while the other half is dequantized), are dequantized and stored straight into the
  block's K/V buffer (NVMMA 128-byte swizzle); the bf16 parts (window rows, the entries' rope dims) are copied
  with ``cp.async``. Ids and pages are loaded blocks ahead into registers, and the next block's rows are
  prefetched into L2 (``PREFETCH``).

Two K/V buffers of 64 x 512 bf16 (128 KB) + Q (64 KB) + P (8 KB) + barriers = 206 KB of shared memory, one CTA
per SM. ``WS3_CONFIG["KV_CHUNKS"] = 8`` (an option; measured 1% faster to 3% slower, so the default stays 1:
NOTES_attention.md "v3.1") stores each K/V buffer as 8 allocations of 64 columns, so that Triton's hazard pass stops
serialising the producer's chunk stores with barriers; the MMAs then run per chunk with the same bits, and the
default build is unchanged (its SASS is byte-identical to the one-allocation kernel's). Barriers (all mbarriers):
``ready[s]`` (producer -> both warpgroups), ``empty[s]`` (both warpgroups -> producer, count 2), ``p_ready`` /
``p_free`` (score <-> value warpgroup), ``ml_ready`` (the final m / l). The score warpgroup stages its bf16 output
through its half of the dead Q buffer (16-byte global stores); the value warpgroup stores directly (its registers
do not fit the staging). ``launch_ws3(times=...)`` builds a timeline probe (global-timer stamps per partition).
"""
from __future__ import annotations

import functools

import torch
import triton

from . import sparse_attention as v1
from .pdl import gl_grid_dependency_prologue, pdl_enabled

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                   warpgroup_mma, warpgroup_mma_wait)

    from .sparse_attention_ws import _load_ids, _load_pages

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    GLUON_AVAILABLE = False

# BLOCK_H = 64 heads (wgmma M); BLOCK_N = 64 rows per block (the score wgmma N); 3 warpgroups of 4 warps
# (score = the default partition, value, producer). Registers per thread at run time (setmaxnreg):
# 128 x (score + VALUE_REGS + PRODUCER_REGS) <= 64 K, the score warpgroup gets the rest.
# PREFETCH: 1 = the producer pulls block b + 1's rows into L2 at block b; 0 = none (benchmarks/results/attn_v3:
# 1 beat 0 and 2 blocks ahead).
# KV_CHUNKS: 1 = each K/V stage is one [BLOCK_N, 512] shared allocation; 8 = eight [BLOCK_N, 64] allocations, one
# per 64-column chunk (``_kv_cols``). Triton's shared-memory hazard pass puts a bar.sync between two stores into one
# allocation (any slices), so with 1 the producer's 7 dequantised chunk stores per half block are serialised by 6
# barriers; with 8 only the second half's first store waits. The MMAs then run per chunk (S: 8 chained wgmmas over K;
# P.V: 4 accumulators of 64 columns per warpgroup), with the same k16 steps and so the same bits.
WS3_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 4, "VALUE_REGS": 160, "PRODUCER_REGS": 152,
              "STAGES": 2, "PREFETCH": 1, "KV_CHUNKS": 1}


def supports(q: torch.Tensor, head_dim: int, nope: int, rope: int, scale_block: int) -> bool:
    """Shapes v3 handles: sm_90 CUDA with V4's row (448 FP8 dims with 64-element scale blocks, 64 bf16 rope dims;
    the producer's FP8 loads are unrolled for 7 chunks). Others run v2 (``sparse_attention_ws.supports``)."""
    from . import sparse_attention_ws

    return (GLUON_AVAILABLE and sparse_attention_ws.supports(q, head_dim, nope, rope, scale_block)
            and (nope, rope, scale_block) == v1.V3_ROW)


if GLUON_AVAILABLE:

    @gluon.jit
    def _stamp(times_ptr, pid, slot: gl.constexpr, TIMES: gl.constexpr):
        """``TIMES`` builds only: the global timer (ns) into ``times_ptr[pid * 16 + slot]`` (a timeline probe of the
        partitions, benchmarks/probe_attention_blocks.py --timeline)."""
        if TIMES:
            one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            anchor = gl.zeros([1], gl.int32, one_l)
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=gl.int64,
                                            is_pure=False, pack=1)
            gl.store(times_ptr + pid * 16 + slot + gl.zeros([1], gl.int64, one_l), now)

    @gluon.jit
    def _stage_views(kv, stage, KV_CHUNKS: gl.constexpr):
        """``stage``'s K/V buffer: (the [BLOCK_N, D] view,) with ``KV_CHUNKS = 1``, else the 8 chunks' [BLOCK_N, 64]
        views (column chunk c = element c)."""
        if KV_CHUNKS == 1:
            return (kv[0].index(stage),)
        else:
            return (kv[0].index(stage), kv[1].index(stage), kv[2].index(stage), kv[3].index(stage),
                    kv[4].index(stage), kv[5].index(stage), kv[6].index(stage), kv[7].index(stage))

    @gluon.jit
    def _rows(views, row0: gl.constexpr, ROWS: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """Rows [row0, row0 + ROWS) of each of ``_stage_views``' views (the producer's half block)."""
        if KV_CHUNKS == 1:
            return (views[0].slice(row0, ROWS, dim=0),)
        else:
            return (views[0].slice(row0, ROWS, dim=0), views[1].slice(row0, ROWS, dim=0),
                    views[2].slice(row0, ROWS, dim=0), views[3].slice(row0, ROWS, dim=0),
                    views[4].slice(row0, ROWS, dim=0), views[5].slice(row0, ROWS, dim=0),
                    views[6].slice(row0, ROWS, dim=0), views[7].slice(row0, ROWS, dim=0))

    @gluon.jit
    def _kv_tile(rows_views, c: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """Columns [64 c, 64 c + 64) of row-sliced stage views (``_stage_views`` with each element sliced to the
        producer's half block)."""
        if KV_CHUNKS == 1:
            return rows_views[0].slice(c * 64, 64, dim=1)
        else:
            return rows_views[c]

    @gluon.jit
    def _prefetch_l2(ptrs):
        """``prefetch.global.L2`` of the line of every pointer (no registers held, nothing waited for)."""
        gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _entry_rows(ids, page, P, EPB: gl.constexpr):
        """(pool row (int64, 0 when invalid), valid) of entry ids with their looked-up pages."""
        valid = (ids >= 0) & (page >= 0) & (page < P)
        return gl.where(valid, page.to(gl.int64) * EPB + gl.where(ids >= 0, ids % EPB, 0), 0), valid

    @gluon.jit
    def _prefetch_half(b, num_wb, ids, page, win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P,
                       D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr,
                       NSC: gl.constexpr, SUB: gl.constexpr, PW: gl.constexpr):
        """Pull half a block's rows into L2 ahead of their loads: one prefetch per 128-byte line (window rows: 8
        lines; entries: 4 lines of FP8 bytes, the rope line, the scales' line). Invalid rows prefetch row 0."""
        pf_l: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [PW, 1], [1, 0])
        rows_pf: gl.constexpr = gl.SliceLayout(1, pf_l)
        if b < num_wb:
            row = gl.convert_layout(gl.where((ids >= 0) & (ids < R), ids, 0).to(gl.int64), rows_pf)
            xw = gl.arange(0, 8, layout=gl.SliceLayout(0, pf_l))[None, :]
            _prefetch_l2(win_kv_ptr + row[:, None] * D + xw * (D // 8))
        else:
            row, valid = _entry_rows(ids, page, P, EPB)
            row = gl.convert_layout(row, rows_pf)
            xf = gl.arange(0, 4, layout=gl.SliceLayout(0, pf_l))[None, :]
            _prefetch_l2(fp8_ptr + row[:, None] * NOPE + xf * 128)
            _prefetch_l2(rope_ptr + row * ROPE)
            _prefetch_l2(scale_ptr + row * NSC)

    @gluon.jit
    def _load_fp8_chunk(c: gl.constexpr, row, valid, fp8_ptr, scale_ptr, NOPE: gl.constexpr, NSC: gl.constexpr,
                        SB: gl.constexpr, sub_l: gl.constexpr):
        """Columns [64 c, 64 c + 64) of the rows' FP8 bytes as 16 int32 words per row (16-byte loads; words, not
        bytes, so that the loop carries 4 registers per thread, not 16) and their block scale per row."""
        xw = gl.arange(0, 16, layout=gl.SliceLayout(0, sub_l))[None, :]
        words = gl.load(fp8_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + row[:, None] * (NOPE // 4) + c * 16 + xw,
                        mask=valid[:, None], other=0)
        scale = gl.load(scale_ptr + row * NSC + (c * 64) // SB, mask=valid, other=0.0)
        return words, scale

    @gluon.jit
    def _load_half(b, num_wb, hi, ids, page, fp8_ptr, scale_ptr, P, NOPE: gl.constexpr, NSC: gl.constexpr,
                   SB: gl.constexpr, EPB: gl.constexpr, sub_l: gl.constexpr):
        """Issue the FP8 loads of half a block (all 7 chunks in flight; none for window blocks or b >= hi).
        V4's row only: NOPE = 7 x 64 (``supports``)."""
        row, valid = _entry_rows(ids, page, P, EPB)
        valid = valid & (b >= num_wb) & (b < hi)
        r0, s0 = _load_fp8_chunk(0, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r1, s1 = _load_fp8_chunk(1, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r2, s2 = _load_fp8_chunk(2, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r3, s3 = _load_fp8_chunk(3, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r4, s4 = _load_fp8_chunk(4, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r5, s5 = _load_fp8_chunk(5, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        r6, s6 = _load_fp8_chunk(6, row, valid, fp8_ptr, scale_ptr, NOPE, NSC, SB, sub_l)
        return r0, r1, r2, r3, r4, r5, r6, s0, s1, s2, s3, s4, s5, s6

    @gluon.jit
    def _dequant_chunk(words, scale, dst):
        """FP8 -> float32 * block scale -> bf16 (RNE, v1's rounding) into ``dst`` (rows x 64 columns): each int32
        word holds 4 E4M3 codes (byte k = column 4 w + k), decoded exactly by ``cvt.rn.f16x2.e4m3x2``."""
        v0, v1, v2, v3 = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, x0, x1, x2, x3; .reg .b32 a, b;\n\t"
            "mov.b32 {lo, hi}, $4;\n\t"
            "cvt.rn.f16x2.e4m3x2 a, lo;\n\t"
            "cvt.rn.f16x2.e4m3x2 b, hi;\n\t"
            "mov.b32 {x0, x1}, a;\n\t"
            "mov.b32 {x2, x3}, b;\n\t"
            "cvt.f32.f16 $0, x0;\n\t"
            "cvt.f32.f16 $1, x1;\n\t"
            "cvt.f32.f16 $2, x2;\n\t"
            "cvt.f32.f16 $3, x3; }",
            "=r,=r,=r,=r,r", [words], dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True,
            pack=1)
        sc = scale[:, None]
        value = gl.join(gl.join(v0 * sc, v2 * sc), gl.join(v1 * sc, v3 * sc))  # [rows, word, a, b]: 4 w + 2 a + b
        value = value.reshape([words.shape[0], words.shape[1] * 4])
        dst.store(value.to(gl.bfloat16))

    @gluon.jit
    def _dequant_half(rows_views, KV_CHUNKS: gl.constexpr, r0, r1, r2, r3, r4, r5, r6, s0, s1, s2, s3, s4, s5, s6):
        """The 7 FP8 chunks of half a block (``_load_half``'s words and scales) into its rows of the stage's K/V
        buffer (``_rows``)."""
        _dequant_chunk(r0, s0, _kv_tile(rows_views, 0, KV_CHUNKS))
        _dequant_chunk(r1, s1, _kv_tile(rows_views, 1, KV_CHUNKS))
        _dequant_chunk(r2, s2, _kv_tile(rows_views, 2, KV_CHUNKS))
        _dequant_chunk(r3, s3, _kv_tile(rows_views, 3, KV_CHUNKS))
        _dequant_chunk(r4, s4, _kv_tile(rows_views, 4, KV_CHUNKS))
        _dequant_chunk(r5, s5, _kv_tile(rows_views, 5, KV_CHUNKS))
        _dequant_chunk(r6, s6, _kv_tile(rows_views, 6, KV_CHUNKS))

    @gluon.jit
    def _copy_half(b, num_wb, ids, page, rows_views, valid_view, win_kv_ptr, rope_ptr, R, P, L, slot_ok,
                   D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr,
                   SUB: gl.constexpr, PW: gl.constexpr, FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr,
                   FLAG_TABLE: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """cp.async the bf16 parts of half a block (window rows, or the entries' rope dims; masked rows
        zero-filled) into its rows of the stage's K/V buffer (``_rows``) and store the rows' validity. Returns the
        rows' int32 error codes (v1's rules)."""
        h_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [PW, 1], [1, 0])      # 32 bf16 columns, 16 B
        xh = gl.arange(0, 64, layout=gl.SliceLayout(0, h_l))[None, :]
        if b < num_wb:
            valid = (ids >= 0) & (ids < R)
            code = ((ids < -1) | (ids >= R)).to(gl.int32) * FLAG_WINDOW  # -1 (none) is not an error
            wrow = gl.convert_layout(gl.where(valid, ids, 0).to(gl.int64), gl.SliceLayout(1, h_l))
            vh = gl.convert_layout(valid, gl.SliceLayout(1, h_l))[:, None]
            for c in gl.static_range(D // 64):
                async_copy.async_copy_global_to_shared(_kv_tile(rows_views, c, KV_CHUNKS),
                                                       win_kv_ptr + wrow[:, None] * D + c * 64 + xh, mask=vh)
        else:
            logical = gl.where(ids >= 0, ids // EPB, 0)
            row, valid = _entry_rows(ids, page, P, EPB)
            code = (slot_ok & ((ids < -1) | ((ids >= 0) & (logical >= L)))).to(gl.int32) * FLAG_ENTRY | \
                ((page < -1) | (page >= P)).to(gl.int32) * FLAG_TABLE
            rh = gl.convert_layout(row, gl.SliceLayout(1, h_l))[:, None]
            vh = gl.convert_layout(valid, gl.SliceLayout(1, h_l))[:, None]
            for c in gl.static_range(ROPE // 64):
                async_copy.async_copy_global_to_shared(
                    _kv_tile(rows_views, NOPE // 64 + c, KV_CHUNKS),
                    rope_ptr + rh * ROPE + c * 64 + xh, mask=vh)
        valid_view.store(valid.to(gl.int32))
        return code

    @gluon.jit
    def _producer_partition(kv, valid_ring, ready, empty, lo, hi, num_wb, n, win_kv_ptr, win_idx_ptr, fp8_ptr,
                            scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, slots_ptr, err_ptr, W, K, R, P, S, L,
                            D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr,
                            NSC: gl.constexpr, SB: gl.constexpr, BLOCK_N: gl.constexpr, PW: gl.constexpr,
                            STAGES: gl.constexpr, FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr,
                            FLAG_SLOTS: gl.constexpr, FLAG_TABLE: gl.constexpr, times_ptr, pid,
                            TIMES: gl.constexpr, PREFETCH: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """Block b = lo + i goes to buffer i % STAGES, in two halves of SUB = BLOCK_N / 2 rows (A, B), software-
        pipelined so that a half's FP8 loads are always in flight while the previous half is dequantized:

        * per block: load the ids of block b + 4 and the pages of block b + 3 into registers (the indices ->
          page -> row chain is never waited for) and (``PREFETCH``) pull block b + 1's rows into L2 (the
          prologue pulls block lo + 1's: measured better than after this block's loads, and than b + 2);
        * issue half B's loads; wait until both warpgroups released the buffer; cp.async the block's bf16 parts;
          dequantize half A (loaded one step earlier) into the buffer;
        * issue the next block's half A loads; dequantize half B; wait for the cp.async group, fence, signal
          ``ready``.

        Each half is one row per thread (8 lanes x PW warps), 7 x 16 bytes of FP8 + 7 scales in flight."""
        SUB: gl.constexpr = BLOCK_N // 2
        sub_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [PW, 1], [1, 0])  # SUB rows x 16 words (64 B)
        srows_l: gl.constexpr = gl.SliceLayout(1, sub_l)
        slot = gl.load(slots_ptr + n)
        slot_ok = (slot >= 0) & (slot < S)
        slot64 = gl.where(slot_ok, slot, 0).to(gl.int64)
        err = gl.zeros([SUB], gl.int32, srows_l) + ((K > 0) & ((slot < -1) | (slot >= S))).to(gl.int32) * FLAG_SLOTS
        i0a = _load_ids(lo, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, 0)
        i0b = _load_ids(lo, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, SUB)
        i1a = _load_ids(lo + 1, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, 0)
        i1b = _load_ids(lo + 1, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, SUB)
        i2a = _load_ids(lo + 2, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, 0)
        i2b = _load_ids(lo + 2, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, SUB)
        i3a = _load_ids(lo + 3, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, 0)
        i3b = _load_ids(lo + 3, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, SUB)
        p0a = _load_pages(lo, num_wb, i0a, table_ptr, slot64, slot_ok, L, EPB)
        p0b = _load_pages(lo, num_wb, i0b, table_ptr, slot64, slot_ok, L, EPB)
        p1a = _load_pages(lo + 1, num_wb, i1a, table_ptr, slot64, slot_ok, L, EPB)
        p1b = _load_pages(lo + 1, num_wb, i1b, table_ptr, slot64, slot_ok, L, EPB)
        p2a = _load_pages(lo + 2, num_wb, i2a, table_ptr, slot64, slot_ok, L, EPB)
        p2b = _load_pages(lo + 2, num_wb, i2b, table_ptr, slot64, slot_ok, L, EPB)
        if (PREFETCH == 1) & (lo + 1 < hi):
            _prefetch_half(lo + 1, num_wb, i1a, p1a, win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, D, NOPE, ROPE,
                           EPB, NSC, SUB, PW)
            _prefetch_half(lo + 1, num_wb, i1b, p1b, win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, D, NOPE, ROPE,
                           EPB, NSC, SUB, PW)
        a0, a1, a2, a3, a4, a5, a6, sa0, sa1, sa2, sa3, sa4, sa5, sa6 = _load_half(
            lo, num_wb, hi, i0a, p0a, fp8_ptr, scale_ptr, P, NOPE, NSC, SB, EPB, sub_l)
        for b in range(lo, hi):
            i = b - lo
            stage = i % STAGES
            views = _stage_views(kv, stage, KV_CHUNKS)
            valid_slot = valid_ring.index(stage)
            i4a = _load_ids(b + 4, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, 0)
            i4b = _load_ids(b + 4, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, srows_l, SUB, SUB)
            p3a = _load_pages(b + 3, num_wb, i3a, table_ptr, slot64, slot_ok, L, EPB)
            p3b = _load_pages(b + 3, num_wb, i3b, table_ptr, slot64, slot_ok, L, EPB)
            if (PREFETCH == 1) & (b + 1 < hi) & (b > lo):  # (the prologue prefetched block lo + 1)
                _prefetch_half(b + 1, num_wb, i1a, p1a, win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, D, NOPE,
                               ROPE, EPB, NSC, SUB, PW)
                _prefetch_half(b + 1, num_wb, i1b, p1b, win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, D, NOPE,
                               ROPE, EPB, NSC, SUB, PW)
            # half B of this block: loads in flight while half A is dequantized
            b0, b1, b2, b3, b4, b5, b6, sb0, sb1, sb2, sb3, sb4, sb5, sb6 = _load_half(
                b, num_wb, hi, i0b, p0b, fp8_ptr, scale_ptr, P, NOPE, NSC, SB, EPB, sub_l)
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            code_a = _copy_half(b, num_wb, i0a, p0a, _rows(views, 0, SUB, KV_CHUNKS), valid_slot.slice(0, SUB),
                                win_kv_ptr, rope_ptr, R, P, L, slot_ok, D, NOPE, ROPE, EPB, SUB, PW, FLAG_WINDOW,
                                FLAG_ENTRY, FLAG_TABLE, KV_CHUNKS)
            code_b = _copy_half(b, num_wb, i0b, p0b, _rows(views, SUB, SUB, KV_CHUNKS), valid_slot.slice(SUB, SUB),
                                win_kv_ptr, rope_ptr, R, P, L, slot_ok, D, NOPE, ROPE, EPB, SUB, PW, FLAG_WINDOW,
                                FLAG_ENTRY, FLAG_TABLE, KV_CHUNKS)
            async_copy.commit_group()
            if FLAG_SLOTS != 0:
                err = err | code_a | code_b
            if b >= num_wb:
                _dequant_half(_rows(views, 0, SUB, KV_CHUNKS), KV_CHUNKS, a0, a1, a2, a3, a4, a5, a6,
                              sa0, sa1, sa2, sa3, sa4, sa5, sa6)
            # half A of the next block: loads in flight while half B is dequantized
            a0, a1, a2, a3, a4, a5, a6, sa0, sa1, sa2, sa3, sa4, sa5, sa6 = _load_half(
                b + 1, num_wb, hi, i1a, p1a, fp8_ptr, scale_ptr, P, NOPE, NSC, SB, EPB, sub_l)
            if b >= num_wb:
                _dequant_half(_rows(views, SUB, SUB, KV_CHUNKS), KV_CHUNKS, b0, b1, b2, b3, b4, b5, b6,
                              sb0, sb1, sb2, sb3, sb4, sb5, sb6)
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(stage), count=1)
            if i == 0:
                _stamp(times_ptr, pid, 7, TIMES)
            i0a, i0b, p0a, p0b = i1a, i1b, p1a, p1b
            i1a, i1b, p1a, p1b = i2a, i2b, p2a, p2b
            i2a, i2b, p2a, p2b = i3a, i3b, p3a, p3b
            i3a, i3b = i4a, i4b
        if FLAG_SLOTS != 0:
            gl.atomic_or(err_ptr + gl.zeros([SUB], gl.int32, srows_l), err, mask=err != 0)
        _stamp(times_ptr, pid, 8, TIMES)

    @gluon.jit
    def _zero_accumulators(BLOCK_H: gl.constexpr, ON: gl.constexpr, o_layout: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """A warpgroup's P.V accumulators for its D/2 columns: one (``KV_CHUNKS = 1``) or four of 64 columns."""
        if KV_CHUNKS == 1:
            return (gl.zeros([BLOCK_H, ON], gl.float32, o_layout),)
        else:
            return (gl.zeros([BLOCK_H, ON], gl.float32, o_layout), gl.zeros([BLOCK_H, ON], gl.float32, o_layout),
                    gl.zeros([BLOCK_H, ON], gl.float32, o_layout), gl.zeros([BLOCK_H, ON], gl.float32, o_layout))

    @gluon.jit
    def _pv_update(p, views, c0: gl.constexpr, DH: gl.constexpr, acc, alpha, KV_CHUNKS: gl.constexpr,
                   P_IN_REGS: gl.constexpr):
        """``acc = acc * alpha + P V[:, 64 c0 : 64 c0 + DH]`` (P: registers with ``P_IN_REGS``, else shared
        memory): one wgmma over the column slice, or four async wgmmas of 64 columns (one per chunk allocation) and
        one wait (which keeps P's registers alive until the last one has read them)."""
        if KV_CHUNKS == 1:
            return (warpgroup_mma(p, views[0].slice(c0 * 64, DH, dim=1), acc[0] * alpha[:, None]),)
        else:
            a0 = warpgroup_mma(p, views[c0 + 0], acc[0] * alpha[:, None], is_async=True)
            a1 = warpgroup_mma(p, views[c0 + 1], acc[1] * alpha[:, None], is_async=True)
            a2 = warpgroup_mma(p, views[c0 + 2], acc[2] * alpha[:, None], is_async=True)
            a3 = warpgroup_mma(p, views[c0 + 3], acc[3] * alpha[:, None], is_async=True)
            if P_IN_REGS:
                r0, r1, r2, r3, _ = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3, p])
                return (r0, r1, r2, r3)
            else:
                return warpgroup_mma_wait(0, deps=[a0, a1, a2, a3])

    @gluon.jit
    def _store_half(m_i, l_i, acc, col0, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                    o_stage, STAGE_OUT: gl.constexpr, WRITE_ML: gl.constexpr, o_layout: gl.constexpr,
                    BLOCK_H: gl.constexpr, D: gl.constexpr, DH: gl.constexpr, SPLIT: gl.constexpr):
        """Columns [col0, col0 + DH) of the (BLOCK_H, D) result: v2's ``_store_result`` for one warpgroup. With
        ``STAGE_OUT`` the bf16 output goes through ``o_stage`` (this warpgroup's half of the dead Q buffer) so that
        the global stores are 16-byte rows, not the accumulator layout's 4-byte pairs (the value warpgroup's
        registers do not fit the staging: it stores directly)."""
        rows_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_o = gl.convert_layout(m_i, rows_l)
        l_o = gl.convert_layout(l_i, rows_l)
        h = head0 + gl.arange(0, BLOCK_H, layout=rows_l)
        hmask = h < H
        d = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
        mask2 = hmask[:, None] & (d < D)[None, :]
        if SPLIT:
            base = n * num_splits + split
            gl.store(ws_acc_ptr + (base * H + h[:, None]) * D + d[None, :], acc, mask=mask2)
            if WRITE_ML:
                gl.store(ws_ml_ptr + base * 2 * H + h, m_o, mask=hmask)
                gl.store(ws_ml_ptr + base * 2 * H + H + h, l_o, mask=hmask)
        else:
            sink = gl.load(sink_ptr + h, mask=hmask, other=0.0) * 1.4426950408889634
            m_use = gl.where(m_o == float("-inf"), 0.0, m_o)
            o = acc / (l_o + gl.exp2(sink - m_use))[:, None]
            # zeros only without a valid row: l == 0 (v1's rule; NaN scores leave m at -inf but make l NaN)
            o = gl.where((l_o == 0.0)[:, None], 0.0, o)
            if STAGE_OUT:
                o_stage.store(o.to(gl.bfloat16))
                gl.thread_barrier()
                if DH >= 128:
                    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
                else:
                    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                hs = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, st_l))
                ds = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, st_l))
                gl.store(out_ptr + (n * H + hs[:, None]) * D + ds[None, :], o_stage.load(st_l),
                         mask=(hs < H)[:, None] & (ds < D)[None, :])
            else:
                gl.store(out_ptr + (n * H + h[:, None]) * D + d[None, :], o.to(gl.bfloat16), mask=mask2)

    @gluon.jit
    def _score_partition(q_ptr, q_smem, kv, valid_ring, p_smem, alpha_smem, m_smem, l_smem, ready, empty, p_ready,
                         p_free, ml_ready, lo, hi, qk_scale, n, head0, split, num_splits, H, sink_ptr, out_ptr,
                         ws_acc_ptr, ws_ml_ptr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                         STAGES: gl.constexpr, SPLIT: gl.constexpr, times_ptr, pid, TIMES: gl.constexpr,
                         KV_CHUNKS: gl.constexpr):
        """S, softmax, P / alpha handed to the value warpgroup, O[:, :D/2] with P from registers (one
        accumulator of D/2 columns, or with ``KV_CHUNKS = 8`` four of 64)."""
        DH: gl.constexpr = D // 2
        ON: gl.constexpr = DH if KV_CHUNKS == 1 else 64  # columns per accumulator
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, ON, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
        acc = _zero_accumulators(BLOCK_H, ON, o_layout, KV_CHUNKS)
        # Q -> shared memory by cp.async (rows past H zero-filled), here rather than before the fork: the producer
        # starts its index chain at once
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        h = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
        x = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
        for c in gl.static_range(D // 64):
            async_copy.async_copy_global_to_shared(q_smem.slice(c * 64, 64, dim=1),
                                                   q_ptr + (n * H + h[:, None]) * D + (c * 64 + x)[None, :],
                                                   mask=(h < H)[:, None])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        _stamp(times_ptr, pid, 1, TIMES)
        for b in range(lo, hi):
            i = b - lo
            stage = i % STAGES
            views = _stage_views(kv, stage, KV_CHUNKS)
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            if i == 0:
                _stamp(times_ptr, pid, 2, TIMES)
            if KV_CHUNKS == 1:
                s = warpgroup_mma(q_smem, views[0].permute([1, 0]), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout),
                                  use_acc=False)
            else:  # the same k16 steps as one wgmma over K = D, chained over the chunks' allocations
                s = warpgroup_mma(q_smem.slice(0, 64, dim=1), views[0].permute([1, 0]),
                                  gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                for c in gl.static_range(1, D // 64):
                    s = warpgroup_mma(q_smem.slice(c * 64, 64, dim=1), views[c].permute([1, 0]), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
            valid = valid_ring.index(stage).load(gl.SliceLayout(0, s_layout))
            s = gl.where(valid[None, :] != 0, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p16 = p.to(gl.bfloat16)
            mbarrier.wait(p_free, (i & 1) ^ 1)  # the value warpgroup has consumed the previous P
            p_smem.store(p16)
            alpha_smem.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready, count=1)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            p_op = gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
            acc = _pv_update(p_op, views, 0, DH, acc, alpha_o, KV_CHUNKS, True)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)
            m_i = m_new
        _stamp(times_ptr, pid, 3, TIMES)
        m_smem.store(m_i)
        l_smem.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(ml_ready, count=1)
        for j in gl.static_range(DH // ON):  # Q is dead after the last S: its columns stage the output
            _store_half(m_i, l_i, acc[j], j * ON, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr,
                        ws_ml_ptr, q_smem.slice(j * ON, ON, dim=1), True, j == 0, o_layout, BLOCK_H, D, ON, SPLIT)
        _stamp(times_ptr, pid, 4, TIMES)

    @gluon.jit
    def _value_partition(kv, p_smem, alpha_smem, m_smem, l_smem, ready, empty, p_ready, p_free, ml_ready, lo, hi,
                         n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                         BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                         SPLIT: gl.constexpr, times_ptr, pid, TIMES: gl.constexpr, KV_CHUNKS: gl.constexpr):
        """O[:, D/2:] += P V[:, D/2:] with P from shared memory, after the score warpgroup's rescale factor."""
        DH: gl.constexpr = D // 2
        ON: gl.constexpr = DH if KV_CHUNKS == 1 else 64
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, ON, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        acc = _zero_accumulators(BLOCK_H, ON, o_layout, KV_CHUNKS)
        for b in range(lo, hi):
            i = b - lo
            stage = i % STAGES
            mbarrier.wait(p_ready, i & 1)  # implies ready[stage]: the score warpgroup waited for it
            alpha = alpha_smem.load(row_l)
            acc = _pv_update(p_smem, _stage_views(kv, stage, KV_CHUNKS), DH // 64, DH, acc, alpha, KV_CHUNKS, False)
            gl.thread_barrier()
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(empty.index(stage), count=1)
        _stamp(times_ptr, pid, 5, TIMES)
        mbarrier.wait(ml_ready, 0)
        m_i = m_smem.load(row_l)
        l_i = l_smem.load(row_l)
        for j in gl.static_range(DH // ON):  # p_smem: unused (no staging)
            _store_half(m_i, l_i, acc[j], DH + j * ON, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr,
                        ws_ml_ptr, p_smem, False, False, o_layout, BLOCK_H, D, ON, SPLIT)
        _stamp(times_ptr, pid, 6, TIMES)

    @gluon.jit
    def _sparse_mqa_ws3_kernel(
        q_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, fp8_ptr, scale_ptr, rope_ptr, table_ptr, slots_ptr, ent_idx_ptr,
        out_ptr, ws_acc_ptr, ws_ml_ptr, err_ptr, times_ptr,
        H, R, W, K, P, S, L, blocks_per_split, num_splits,
        qk_scale,
        D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr, NSC: gl.constexpr,
        SB: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, TIMES: gl.constexpr,
        PREFETCH: gl.constexpr, KV_CHUNKS: gl.constexpr,
        VALUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, STAGES: gl.constexpr,
        FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr, FLAG_SLOTS: gl.constexpr, FLAG_TABLE: gl.constexpr,
        num_warps: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Arguments as v1's ``_sparse_mqa_kernel`` (fp8_ptr: the uint8 view). Grid (N, cdiv(H, 64), splits)."""
        gl_grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
        n = gl.program_id(0).to(gl.int64)
        head0 = gl.program_id(1) * BLOCK_H
        split = gl.program_id(2)
        pid = (n * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + split
        _stamp(times_ptr, pid, 0, TIMES)
        num_wb = gl.cdiv(W, BLOCK_N)
        num_blocks = num_wb + gl.cdiv(K, BLOCK_N)
        lo = split * blocks_per_split
        hi = gl.minimum(lo + blocks_per_split, num_blocks)

        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
        v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
        if KV_CHUNKS == 1:
            kv = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], kv_sl),)
        else:  # one allocation per 64-column chunk (WS3_CONFIG): V4's row, D = 512
            gl.static_assert(D == 512)
            c_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
            kv = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl),
                  gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], c_sl))
        valid_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], v_sl)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], v_sl)
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], v_sl)
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], v_sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ml_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # the score and the value warpgroup
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(ml_ready, count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_score_partition, (q_ptr, q_smem, kv, valid_ring, p_smem, alpha_smem, m_smem, l_smem, ready, empty,
                                p_ready, p_free, ml_ready, lo, hi, qk_scale, n, head0, split, num_splits, H, sink_ptr,
                                out_ptr, ws_acc_ptr, ws_ml_ptr, BLOCK_H, BLOCK_N, D, STAGES, SPLIT, times_ptr, pid,
                                TIMES, KV_CHUNKS)),
            (_value_partition, (kv, p_smem, alpha_smem, m_smem, l_smem, ready, empty, p_ready, p_free, ml_ready, lo,
                                hi, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, BLOCK_H,
                                BLOCK_N, D, STAGES, SPLIT, times_ptr, pid, TIMES, KV_CHUNKS)),
            (_producer_partition, (kv, valid_ring, ready, empty, lo, hi, num_wb, n, win_kv_ptr, win_idx_ptr,
                                   fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, slots_ptr, err_ptr, W, K, R,
                                   P, S, L, D, NOPE, ROPE, EPB, NSC, SB, BLOCK_N, 4, STAGES, FLAG_WINDOW,
                                   FLAG_ENTRY, FLAG_SLOTS, FLAG_TABLE, times_ptr, pid, TIMES, PREFETCH, KV_CHUNKS)),
        ], [4, 4], [VALUE_REGS, PRODUCER_REGS])


def _constants(nope, rope, scale_block, entries_per_block, split, config=None, times=False):
    cfg = dict(WS3_CONFIG, **(config or {}))
    return cfg, dict(D=nope + rope, NOPE=nope, ROPE=rope, EPB=entries_per_block, NSC=nope // scale_block,
                     SB=scale_block, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split, TIMES=times,
                     VALUE_REGS=cfg["VALUE_REGS"], PRODUCER_REGS=cfg["PRODUCER_REGS"], STAGES=cfg["STAGES"],
                     PREFETCH=cfg["PREFETCH"], KV_CHUNKS=cfg["KV_CHUNKS"],
                     **v1.error_flags())


def launch_ws3(q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
               block_table, slots, entry_idx, out, *, splits: int, per: int, ws_acc, ws_ml, error_word,
               compile_only: bool = False, pdl: bool | None = None, times: torch.Tensor | None = None,
               config: dict | None = None, launch_pdl: bool | None = None):
    """Launch the v3 main kernel (v1's launcher calls this with a split layout in ``WS3_CONFIG["BLOCK_N"]``-row
    blocks and its workspace). ``compile_only``: compile without launching. ``pdl``: programmatic dependent
    launch: the build with the prologue (None: ``megamoe.kernels.pdl.pdl_enabled(q)``); ``launch_pdl``: whether it is
    launched with PDL (None: as ``pdl``; launched plainly, the prologue's wait is a no-op). ``times``: a probe build
    that writes 9 global-timer stamps per program into this int64 tensor of >= 16 x programs elements (``_stamp``'s
    slots: 0 entry, 1 Q in shared memory, 2 first block ready, 3 / 4 score loop / epilogue end, 5 / 6 value loop /
    epilogue end, 7 first block produced, 8 producer end). ``config``: overrides of ``WS3_CONFIG`` (experiments)."""
    N, H, D = q.shape
    W, K = window_idx.shape[1], entry_idx.shape[1]
    P, EPB, nope = entries_fp8.shape
    rope = entries_rope.shape[-1]
    sb = nope // entries_scale.shape[-1]
    cfg, constants = _constants(nope, rope, sb, EPB, splits > 1, config, times=times is not None)
    grid = (N, triton.cdiv(H, cfg["BLOCK_H"]), splits)
    pdl = pdl_enabled(q) if pdl is None else pdl
    launch_pdl = pdl if launch_pdl is None else launch_pdl
    launcher = functools.partial(_sparse_mqa_ws3_kernel.warmup, grid=grid) if compile_only else \
        _sparse_mqa_ws3_kernel[grid]
    launcher(
        q, attn_sink, window_kv, window_idx, entries_fp8.view(torch.uint8), entries_scale, entries_rope,
        block_table, slots, entry_idx, out, ws_acc, ws_ml, error_word, times if times is not None else error_word,
        H, window_kv.shape[0], W, K, P, block_table.shape[0], block_table.shape[1], per, splits,
        float(softmax_scale) * v1.LOG2E, **constants, num_warps=cfg["num_warps"], PDL=pdl, launch_pdl=launch_pdl)


def compile_sm90(*, head_dim: int = 512, rope_dim: int = 64, scale_block: int = 64, entries_per_block: int = 64,
                 split: bool = False, config: dict | None = None, pdl: bool = False, times: bool = False):
    """Compile the v3 kernel for sm_90 without a GPU; returns the ``CompiledKernel`` (``times``: the timeline
    probe build)."""
    from .sparse_attention_ws import compile_gluon_sm90

    cfg, constants = _constants(head_dim - rope_dim, rope_dim, scale_block, entries_per_block, split, config, times)
    return compile_gluon_sm90(_sparse_mqa_ws3_kernel, constants, cfg["num_warps"], pdl,
                              extra_pointers={"times_ptr": "*i64"})
