"""Sparse FP8 MQA attention of DeepSeek-V4, v2: a Gluon (sm_90) kernel with a shared-memory pipeline.

Same semantics, arguments, error bits, block order and split rule as v1 (``sparse_attention.py``): the
row list of a query is ``[window blocks | entry blocks]`` in BLOCK_N = ``ATTENTION_CONFIG["BLOCK_N"]`` row
blocks, a split owns blocks ``[split * per, (split + 1) * per)`` from v1's :func:`choose_num_splits`, every
split starts from ``m = -inf``, and ``num_splits > 1`` ends in v1's ``_combine_kernel`` (fixed split order).
Per block: ``s = (Q K^T) * scale * log2(e)`` (invalid rows ``-inf``), ``m_new = max(m, max_j s)``,
``p = exp2(s - m_new)`` (float32, summed into the denominator), ``O = O * alpha + bf16(p) V``: the
numeric contract of v1, so v1's bf16-P mirror applies to both. Selected at run time with
``launch_sparse_mqa_attention(..., impl="ws")`` of v1's launcher (default ``"v1"``: OFF until validated on
the GPU).

Structure (one CTA = one query token x 64 heads x one split; 12 warps):

* Q (64 x 512 bf16, 64 KB) is staged once into NVMMA-swizzled shared memory.
* Producer partition (4 warps, ``PRODUCER_REGS`` registers), software-pipelined over the split's blocks: at
  iteration i it loads the ids of block i + 3 and the pages of block i + 2 (register prefetch, so the
  indices -> page -> row chain is never waited for), issues block i + 1's gathers with ``cp.async`` (masked
  rows zero-filled): window rows (bf16) and entry rope dims straight into the kv ring slot, entry FP8 bytes
  and scales into a 2-deep staging buffer; then waits for block i's copies (``cp.async.wait_group 1``),
  dequantizes its FP8 bytes (float32 * block scale -> bf16, exactly v1's rounding) into the slot's first 448
  columns, ``fence`` + ``mbarrier.arrive(ready)``. The kv ring is ``NUM_KV_STAGES`` deep (NVMMA 128-byte
  swizzle, the wgmma B operand); the rows' validity travels in a small int32 ring next to it. Error codes are
  ORed per lane; one atomic at the end.
* Default (consumer) partition, 8 warps = 2 warpgroups, wgmma layout ``warps_per_cta = [4, 2]``: the score
  tile ``64 x BLOCK_N`` is split by rows (each warpgroup computes 64 x BLOCK_N/2: no duplicated MMA), the
  row max / sum cross the two warpgroups through shared memory (compiler-generated), P is converted to the
  A-operand layout (each warpgroup needs all BLOCK_N columns) and ``O (64 x 512)`` is split by columns:
  each warpgroup owns 64 x 256 fp32 = 128 accumulator registers per thread. Then ``mbarrier.arrive(empty)``.
* ``MEGAMOE_ATTN_WS=0`` (read at launch) selects the non-warp-specialized variant of the same shared-memory
  pipeline for debugging: 8 warps, one ring slot, produce -> barrier -> consume per block.

Shared memory (V4, BLOCK_N 32, 3 kv stages): Q 64 KB + kv ring 96 KB + staging 2 x 17 KB + ~7 KB compiler
scratch = 203 KB. Not yet (benchmarks/NOTES_attention.md "v2 (Gluon)"): H = 128 sharing of the dequantized
tile, fused split combine, a persistent grid.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from . import sparse_attention as v1
from .pdl import gl_grid_dependency_prologue, pdl_enabled

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                   warpgroup_mma)

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    GLUON_AVAILABLE = False

# BLOCK_H = 64 heads (wgmma M), BLOCK_N as v1 (the numeric contract: same blocks, same splits), 8 consumer
# warps + 4 producer warps. Shared memory: Q 64 KB + NUM_KV_STAGES x BLOCK_N x 1 KB (+ compiler scratch for
# the P / reduction exchanges). Registers: 8 x 32 x CONSUMER + 4 x 32 x PRODUCER <= 64 K.
WS_CONFIG = {"BLOCK_H": 64, "BLOCK_N": v1.ATTENTION_CONFIG["BLOCK_N"], "num_warps": 8, "PRODUCER_WARPS": 4,
             "PRODUCER_REGS": 88, "NUM_KV_STAGES": 3}


def warp_specialized() -> bool:
    """``MEGAMOE_ATTN_WS`` (default 1): 0 = the non-warp-specialized debugging variant."""
    return os.environ.get("MEGAMOE_ATTN_WS", "1") != "0"


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def supports(q: torch.Tensor, head_dim: int, nope: int, rope: int, scale_block: int) -> bool:
    """Shapes the v2 kernel handles: sm_90 CUDA, D = 512 (nope and rope multiples of 64, scale block 64k)."""
    if not (GLUON_AVAILABLE and q.is_cuda and _capability(q.device.index or 0)[0] == 9):
        return False
    return head_dim == 512 and nope % 64 == 0 and rope % 64 == 0 and scale_block % 64 == 0 and nope + rope == head_dim


if GLUON_AVAILABLE:

    @gluon.jit
    def _load_ids(b, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N: gl.constexpr, rows_l: gl.constexpr,
                  ROWS: gl.constexpr, FIRST: gl.constexpr):
        """Rows [FIRST, FIRST + ROWS) of block b (BLOCK_N rows): window ids or entry ids (-1 past the list or when
        b >= hi). v2 loads whole blocks (ROWS = BLOCK_N, FIRST = 0), v3 half blocks."""
        jj = FIRST + gl.arange(0, ROWS, layout=rows_l)
        if b < num_wb:
            j = b * BLOCK_N + jj
            ids = gl.load(win_idx_ptr + n * W + j, mask=(j < W) & (b < hi), other=-1)
        else:
            j = (b - num_wb) * BLOCK_N + jj
            ids = gl.load(ent_idx_ptr + n * K + j, mask=(j < K) & (b < hi), other=-1)
        return ids

    @gluon.jit
    def _load_pages(b, num_wb, ids, table_ptr, slot64, slot_ok, L, EPB: gl.constexpr):
        """Entry blocks: the physical page of every id (-1 when not looked up); window blocks: all -1."""
        logical = gl.where(ids >= 0, ids // EPB, 0)
        return gl.load(table_ptr + slot64 * L + logical, mask=(b >= num_wb) & (ids >= 0) & (logical < L) & slot_ok,
                       other=-1)

    @gluon.jit
    def _issue_block(b, num_wb, ids, page, kv_slot, valid_slot, fp8_st, sc_st, win_kv_ptr, fp8_ptr, scale_ptr,
                     rope_ptr, R, P, L, slot_ok,
                     D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr,
                     NSC: gl.constexpr, BLOCK_N: gl.constexpr, PW: gl.constexpr,
                     FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr, FLAG_TABLE: gl.constexpr):
        """Issue block b's cp.async gathers (masked rows zero-filled): window rows (bf16) and entry rope dims
        straight into the kv slot, entry FP8 bytes and scales into the staging buffers; store the rows' validity.
        Returns the (BLOCK_N,) int32 error codes of the rows (v1's rules)."""
        rows_l: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0]))
        h_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])      # 64 bf16 columns, 16 B
        b_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [PW, 1], [1, 0])     # 64 byte columns, 16 B
        s_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [PW, 1], [1, 0])      # 8 scale columns
        code = gl.zeros([BLOCK_N], gl.int32, rows_l)
        if b < num_wb:
            valid = (ids >= 0) & (ids < R)
            if FLAG_WINDOW != 0:
                code = ((ids < -1) | (ids >= R)).to(gl.int32) * FLAG_WINDOW  # -1 (none) is not an error
            row = gl.convert_layout(gl.where(valid, ids, 0).to(gl.int64), gl.SliceLayout(1, h_l))
            vh = gl.convert_layout(valid, gl.SliceLayout(1, h_l))[:, None]
            xh = gl.arange(0, 64, layout=gl.SliceLayout(0, h_l))[None, :]
            for c in gl.static_range(D // 64):
                async_copy.async_copy_global_to_shared(kv_slot.slice(c * 64, 64, dim=1),
                                                       win_kv_ptr + row[:, None] * D + c * 64 + xh, mask=vh)
        else:
            logical = gl.where(ids >= 0, ids // EPB, 0)
            valid = (ids >= 0) & (page >= 0) & (page < P)
            if FLAG_ENTRY != 0:
                code = (slot_ok & ((ids < -1) | ((ids >= 0) & (logical >= L)))).to(gl.int32) * FLAG_ENTRY | \
                    ((page < -1) | (page >= P)).to(gl.int32) * FLAG_TABLE
            row = gl.where(valid, page.to(gl.int64) * EPB + gl.where(ids >= 0, ids % EPB, 0), 0)
            rb = gl.convert_layout(row, gl.SliceLayout(1, b_l))[:, None]
            vb = gl.convert_layout(valid, gl.SliceLayout(1, b_l))[:, None]
            xb = gl.arange(0, 64, layout=gl.SliceLayout(0, b_l))[None, :]
            for c in gl.static_range(NOPE // 64):
                async_copy.async_copy_global_to_shared(fp8_st.slice(c * 64, 64, dim=1),
                                                       fp8_ptr + rb * NOPE + c * 64 + xb, mask=vb)
            rs = gl.convert_layout(row, gl.SliceLayout(1, s_l))[:, None]
            vs = gl.convert_layout(valid, gl.SliceLayout(1, s_l))[:, None]
            xs = gl.arange(0, 8, layout=gl.SliceLayout(0, s_l))[None, :]
            async_copy.async_copy_global_to_shared(sc_st, scale_ptr + rs * NSC + xs, mask=vs & (xs < NSC))
            rh = gl.convert_layout(row, gl.SliceLayout(1, h_l))[:, None]
            vh = gl.convert_layout(valid, gl.SliceLayout(1, h_l))[:, None]
            xh = gl.arange(0, 64, layout=gl.SliceLayout(0, h_l))[None, :]
            for c in gl.static_range(ROPE // 64):
                async_copy.async_copy_global_to_shared(kv_slot.slice(NOPE + c * 64, 64, dim=1),
                                                       rope_ptr + rh * ROPE + c * 64 + xh, mask=vh)
        valid_slot.store(valid.to(gl.int32))
        return code

    @gluon.jit
    def _dequant_block(b, num_wb, kv_slot, fp8_st, sc_st, NOPE: gl.constexpr, SB: gl.constexpr,
                       BLOCK_N: gl.constexpr, PW: gl.constexpr):
        """Entry blocks: staged FP8 bytes -> float32 * their block scale -> bf16 (v1's rounding) into the kv
        slot's first NOPE columns (after the block's copies completed and the partition synchronised)."""
        if b >= num_wb:
            b_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [PW, 1], [1, 0])
            s_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [PW, 1], [1, 0])
            sc = sc_st.load(s_l)
            xs = gl.arange(0, 8, layout=gl.SliceLayout(0, s_l))[None, :]
            for c in gl.static_range(NOPE // 64):
                blk = gl.sum(gl.where(xs == (c * 64) // SB, sc, 0.0), axis=1)
                blk = gl.convert_layout(blk, gl.SliceLayout(1, b_l))
                raw = fp8_st.slice(c * 64, 64, dim=1).load(b_l)
                value = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * blk[:, None]
                kv_slot.slice(c * 64, 64, dim=1).store(value.to(gl.bfloat16))

    @gluon.jit
    def _consume_block(q_smem, kv_buf, valid_buf, m_i, l_i, acc, qk_scale,
                       s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr):
        """One online-softmax step (v1's contract): S = Q K^T split by rows over the two warpgroups,
        O += bf16(P) V split by columns."""
        s = warpgroup_mma(q_smem, kv_buf.permute([1, 0]), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout),
                          use_acc=False)
        valid = valid_buf.load(gl.SliceLayout(0, s_layout))
        s = gl.where(valid[None, :] != 0, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        p_op = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        acc = warpgroup_mma(p_op, kv_buf, acc * alpha_o[:, None])
        return m_new, l_i, acc

    @gluon.jit
    def _producer_partition(kv_ring, valid_ring, fp8_stage, sc_stage, ready, empty, lo, hi, num_wb, n, win_kv_ptr,
                            win_idx_ptr, fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr, slots_ptr, err_ptr,
                            W, K, R, P, S, L,
                            D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr,
                            NSC: gl.constexpr, SB: gl.constexpr, BLOCK_N: gl.constexpr, PW: gl.constexpr,
                            STAGES: gl.constexpr, FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr,
                            FLAG_SLOTS: gl.constexpr, FLAG_TABLE: gl.constexpr):
        """Software pipeline over the split's blocks: at iteration i (block b = lo + i) the ids of block b + 3 and
        the pages of block b + 2 are loaded into registers, block b + 1's gathers are issued (cp.async, one
        commit group per iteration) into kv slot (i + 1) % STAGES and staging buffer (i + 1) % 2, then block b's
        group is waited for, dequantized and handed to the consumers (mbarrier ready). So each block's index
        loads and row gathers are in flight while the previous blocks are dequantized and multiplied."""
        rows_l: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0]))
        slot = gl.load(slots_ptr + n)
        slot_ok = (slot >= 0) & (slot < S)
        slot64 = gl.where(slot_ok, slot, 0).to(gl.int64)
        err = gl.zeros([BLOCK_N], gl.int32, rows_l) + \
            ((K > 0) & ((slot < -1) | (slot >= S))).to(gl.int32) * FLAG_SLOTS
        # prologue: block lo issued; pages of lo + 1 and ids of lo + 2 in registers
        ids0 = _load_ids(lo, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, rows_l, BLOCK_N, 0)
        ids1 = _load_ids(lo + 1, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, rows_l, BLOCK_N, 0)
        ids2 = _load_ids(lo + 2, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, rows_l, BLOCK_N, 0)
        pg0 = _load_pages(lo, num_wb, ids0, table_ptr, slot64, slot_ok, L, EPB)
        pg1 = _load_pages(lo + 1, num_wb, ids1, table_ptr, slot64, slot_ok, L, EPB)
        if lo < hi:
            mbarrier.wait(empty.index(0), 1)
            code = _issue_block(lo, num_wb, ids0, pg0, kv_ring.index(0), valid_ring.index(0), fp8_stage.index(0),
                                sc_stage.index(0), win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, L, slot_ok,
                                D, NOPE, ROPE, EPB, NSC, BLOCK_N, PW, FLAG_WINDOW, FLAG_ENTRY, FLAG_TABLE)
            if FLAG_SLOTS != 0:
                err = err | code
        async_copy.commit_group()
        for b in range(lo, hi):
            i = b - lo
            nxt = i + 1
            ids3 = _load_ids(b + 3, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, rows_l, BLOCK_N, 0)
            pg2 = _load_pages(b + 2, num_wb, ids2, table_ptr, slot64, slot_ok, L, EPB)
            if b + 1 < hi:
                mbarrier.wait(empty.index(nxt % STAGES), ((nxt // STAGES) & 1) ^ 1)
                code = _issue_block(b + 1, num_wb, ids1, pg1, kv_ring.index(nxt % STAGES),
                                    valid_ring.index(nxt % STAGES), fp8_stage.index(nxt % 2), sc_stage.index(nxt % 2),
                                    win_kv_ptr, fp8_ptr, scale_ptr, rope_ptr, R, P, L, slot_ok,
                                    D, NOPE, ROPE, EPB, NSC, BLOCK_N, PW, FLAG_WINDOW, FLAG_ENTRY, FLAG_TABLE)
                if FLAG_SLOTS != 0:
                    err = err | code
            async_copy.commit_group()
            async_copy.wait_group(1)      # block b's group (committed one iteration earlier) has landed
            gl.thread_barrier()           # ... for every producer thread
            _dequant_block(b, num_wb, kv_ring.index(i % STAGES), fp8_stage.index(i % 2), sc_stage.index(i % 2),
                           NOPE, SB, BLOCK_N, PW)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(i % STAGES), count=1)
            ids1, pg1 = ids2, pg2
            ids2 = ids3
        async_copy.wait_group(0)
        if FLAG_SLOTS != 0:
            gl.atomic_or(err_ptr + gl.zeros([BLOCK_N], gl.int32, rows_l), err, mask=err != 0)

    @gluon.jit
    def _consumer_partition(q_smem, kv_ring, valid_ring, ready, empty, lo, hi, qk_scale,
                            s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_H: gl.constexpr,
                            BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_H, D], gl.float32, o_layout)
        for b in range(lo, hi):
            i = b - lo
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            m_i, l_i, acc = _consume_block(q_smem, kv_ring.index(stage), valid_ring.index(stage), m_i, l_i, acc,
                                           qk_scale, s_layout, o_layout, BLOCK_H, BLOCK_N)
            gl.thread_barrier()  # both warpgroups' (synchronous) wgmmas have read the slot
            mbarrier.arrive(empty.index(stage), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _store_result(m_i, l_i, acc, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                      o_layout: gl.constexpr, BLOCK_H: gl.constexpr, D: gl.constexpr, SPLIT: gl.constexpr):
        rows_l: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_o = gl.convert_layout(m_i, rows_l)
        l_o = gl.convert_layout(l_i, rows_l)
        h = head0 + gl.arange(0, BLOCK_H, layout=rows_l)
        hmask = h < H
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        mask2 = hmask[:, None] & (d < D)[None, :]
        if SPLIT:
            base = n * num_splits + split
            gl.store(ws_acc_ptr + (base * H + h[:, None]) * D + d[None, :], acc, mask=mask2)
            gl.store(ws_ml_ptr + base * 2 * H + h, m_o, mask=hmask)
            gl.store(ws_ml_ptr + base * 2 * H + H + h, l_o, mask=hmask)
        else:
            sink = gl.load(sink_ptr + h, mask=hmask, other=0.0) * 1.4426950408889634
            m_use = gl.where(m_o == float("-inf"), 0.0, m_o)
            o = acc / (l_o + gl.exp2(sink - m_use))[:, None]
            # zeros only without a valid row: l == 0 (v1's rule; NaN scores leave m at -inf but make l NaN)
            o = gl.where((l_o == 0.0)[:, None], 0.0, o)
            gl.store(out_ptr + (n * H + h[:, None]) * D + d[None, :], o.to(gl.bfloat16), mask=mask2)

    @gluon.jit
    def _sparse_mqa_ws_kernel(
        q_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, fp8_ptr, scale_ptr, rope_ptr, table_ptr, slots_ptr, ent_idx_ptr,
        out_ptr, ws_acc_ptr, ws_ml_ptr, err_ptr,
        H, R, W, K, P, S, L, blocks_per_split, num_splits,
        qk_scale,
        D: gl.constexpr, NOPE: gl.constexpr, ROPE: gl.constexpr, EPB: gl.constexpr, NSC: gl.constexpr,
        SB: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr,
        WARP_SPECIALIZE: gl.constexpr, PW: gl.constexpr, PRODUCER_REGS: gl.constexpr, STAGES: gl.constexpr,
        FLAG_WINDOW: gl.constexpr, FLAG_ENTRY: gl.constexpr, FLAG_SLOTS: gl.constexpr, FLAG_TABLE: gl.constexpr,
        num_warps: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Arguments as v1's ``_sparse_mqa_kernel`` (fp8_ptr: the uint8 view). Grid (N, cdiv(H, 64), splits)."""
        gl_grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
        n = gl.program_id(0).to(gl.int64)
        head0 = gl.program_id(1) * BLOCK_H
        split = gl.program_id(2)
        num_wb = gl.cdiv(W, BLOCK_N)
        num_blocks = num_wb + gl.cdiv(K, BLOCK_N)
        lo = split * blocks_per_split
        hi = gl.minimum(lo + blocks_per_split, num_blocks)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, D // 2, 16])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
        v_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        # Q -> shared memory (all 8 warps, 64-column chunks)
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        h = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
        x = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
        for c in gl.static_range(D // 64):
            qc = gl.load(q_ptr + (n * H + h[:, None]) * D + (c * 64 + x)[None, :], mask=(h < H)[:, None], other=0.0)
            q_smem.slice(c * 64, 64, dim=1).store(qc)

        # staging of the raw entry rows: FP8 bytes (BLOCK_N, 512) u8 (448 used) and scales (BLOCK_N, 8) float32
        st_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if WARP_SPECIALIZE:
            kv_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], kv_sl)
            valid_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], v_sl)
            fp8_stage = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, D], st_sl)
            sc_stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, 8], st_sl)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=1)
            fence_async_shared()
            gl.thread_barrier()
            m_i, l_i, acc = gl.warp_specialize([
                (_consumer_partition, (q_smem, kv_ring, valid_ring, ready, empty, lo, hi, qk_scale, s_layout,
                                       o_layout, BLOCK_H, BLOCK_N, D, STAGES)),
                (_producer_partition, (kv_ring, valid_ring, fp8_stage, sc_stage, ready, empty, lo, hi, num_wb, n,
                                       win_kv_ptr, win_idx_ptr, fp8_ptr, scale_ptr, rope_ptr, table_ptr, ent_idx_ptr,
                                       slots_ptr, err_ptr, W, K, R, P, S, L, D, NOPE, ROPE, EPB, NSC, SB, BLOCK_N, PW,
                                       STAGES, FLAG_WINDOW, FLAG_ENTRY, FLAG_SLOTS, FLAG_TABLE)),
            ], [PW], [PRODUCER_REGS])
        else:
            # debugging variant: the same gathers / staging / dequant / MMAs, one block at a time by all 8 warps
            kv_buf = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], kv_sl)
            valid_buf = gl.allocate_shared_memory(gl.int32, [BLOCK_N], v_sl)
            fp8_buf = gl.allocate_shared_memory(gl.uint8, [BLOCK_N, D], st_sl)
            sc_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_N, 8], st_sl)
            rows_l: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0]))
            slot = gl.load(slots_ptr + n)
            slot_ok = (slot >= 0) & (slot < S)
            slot64 = gl.where(slot_ok, slot, 0).to(gl.int64)
            err = gl.zeros([BLOCK_N], gl.int32, rows_l) + \
                ((K > 0) & ((slot < -1) | (slot >= S))).to(gl.int32) * FLAG_SLOTS
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_H, D], gl.float32, o_layout)
            for b in range(lo, hi):
                ids = _load_ids(b, hi, num_wb, n, win_idx_ptr, ent_idx_ptr, W, K, BLOCK_N, rows_l, BLOCK_N, 0)
                pg = _load_pages(b, num_wb, ids, table_ptr, slot64, slot_ok, L, EPB)
                gl.thread_barrier()  # the previous block's wgmmas have read the tile
                code = _issue_block(b, num_wb, ids, pg, kv_buf, valid_buf, fp8_buf, sc_buf, win_kv_ptr, fp8_ptr,
                                    scale_ptr, rope_ptr, R, P, L, slot_ok, D, NOPE, ROPE, EPB, NSC, BLOCK_N, num_warps,
                                    FLAG_WINDOW, FLAG_ENTRY, FLAG_TABLE)
                if FLAG_SLOTS != 0:
                    err = err | code
                async_copy.commit_group()
                async_copy.wait_group(0)
                gl.thread_barrier()
                _dequant_block(b, num_wb, kv_buf, fp8_buf, sc_buf, NOPE, SB, BLOCK_N, num_warps)
                fence_async_shared()
                gl.thread_barrier()
                m_i, l_i, acc = _consume_block(q_smem, kv_buf, valid_buf, m_i, l_i, acc, qk_scale, s_layout,
                                               o_layout, BLOCK_H, BLOCK_N)
            if FLAG_SLOTS != 0:
                gl.atomic_or(err_ptr + gl.zeros([BLOCK_N], gl.int32, rows_l), err, mask=err != 0)
        _store_result(m_i, l_i, acc, n, head0, split, num_splits, H, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                      o_layout, BLOCK_H, D, SPLIT)


def _constants(nope, rope, scale_block, entries_per_block, split, warp_spec, config=None):
    cfg = dict(WS_CONFIG, **(config or {}))
    return cfg, dict(D=nope + rope, NOPE=nope, ROPE=rope, EPB=entries_per_block, NSC=nope // scale_block,
                     SB=scale_block, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split,
                     WARP_SPECIALIZE=warp_spec, PW=cfg["PRODUCER_WARPS"], PRODUCER_REGS=cfg["PRODUCER_REGS"],
                     STAGES=cfg["NUM_KV_STAGES"], **v1.error_flags())


def launch_ws(q, attn_sink, softmax_scale, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
              block_table, slots, entry_idx, out, *, splits: int, per: int, ws_acc, ws_ml, error_word,
              warp_spec: bool | None = None, compile_only: bool = False, pdl: bool | None = None,
              launch_pdl: bool | None = None):
    """Launch the v2 main kernel (v1's launcher calls this with its split layout and workspace).
    ``compile_only``: compile (``warmup``) without launching (benchmarks/validate_attention_ws.py). ``pdl``:
    programmatic dependent launch: the build with the prologue (None: ``megamoe.kernels.pdl.pdl_enabled(q)``);
    ``launch_pdl``: whether it is launched with PDL (None: as ``pdl``)."""
    N, H, D = q.shape
    W, K = window_idx.shape[1], entry_idx.shape[1]
    P, EPB, nope = entries_fp8.shape
    rope = entries_rope.shape[-1]
    sb = nope // entries_scale.shape[-1]
    ws = warp_specialized() if warp_spec is None else warp_spec
    cfg, constants = _constants(nope, rope, sb, EPB, splits > 1, ws)
    grid = (N, triton.cdiv(H, cfg["BLOCK_H"]), splits)
    pdl = pdl_enabled(q) if pdl is None else pdl
    launch_pdl = pdl if launch_pdl is None else launch_pdl
    launcher = functools.partial(_sparse_mqa_ws_kernel.warmup, grid=grid) if compile_only else \
        _sparse_mqa_ws_kernel[grid]
    launcher(
        q, attn_sink, window_kv, window_idx, entries_fp8.view(torch.uint8), entries_scale, entries_rope,
        block_table, slots, entry_idx, out, ws_acc, ws_ml, error_word,
        H, window_kv.shape[0], W, K, P, block_table.shape[0], block_table.shape[1], per, splits,
        float(softmax_scale) * v1.LOG2E, **constants, num_warps=cfg["num_warps"], PDL=pdl, launch_pdl=launch_pdl)


def compile_gluon_sm90(kernel, constants: dict, num_warps: int, pdl: bool, extra_pointers: dict | None = None):
    """Offline sm_90 compile (no GPU) of a Gluon main kernel with v1's pointer and scalar signature (v2 / v3);
    ``extra_pointers`` (name -> type) follow ``err_ptr``. Returns the ``CompiledKernel``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = dict(constants, num_warps=num_warps, PDL=pdl)
    signature = dict(v1._MAIN_POINTERS, **(extra_pointers or {}), **{name: "i32" for name in v1._MAIN_SCALARS},
                     qk_scale="fp32", **{name: "constexpr" for name in constants})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in v1._MAIN_POINTERS
             if name != "err_ptr"}
    source = GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                              "launch_pdl": pdl})


def compile_sm90(*, head_dim: int = 512, rope_dim: int = 64, scale_block: int = 64, entries_per_block: int = 64,
                 split: bool = False, warp_spec: bool = True, config: dict | None = None, pdl: bool = False):
    """Compile the v2 kernel for sm_90 without a GPU; returns the ``CompiledKernel`` (n_regs, n_spills,
    metadata.shared, asm). ``pdl``: the programmatic-dependent-launch build."""
    cfg, constants = _constants(head_dim - rope_dim, rope_dim, scale_block, entries_per_block, split, warp_spec,
                                config)
    return compile_gluon_sm90(_sparse_mqa_ws_kernel, constants, cfg["num_warps"], pdl)
