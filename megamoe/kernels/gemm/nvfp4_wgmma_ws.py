"""Warp-specialized NVFP4 x bf16 grouped GEMM on Hopper (Gluon, async ``wgmma`` from shared memory).

One kernel, one launcher (:func:`launch_nvfp4_wgmma_ws`). Issue 10 item 1; design and offline numbers in
``benchmarks/NOTES_gemm.md`` (v14). Routed above 256 rows per expert by default:
``megamoe.ops.gemm.WS_ROUTE`` / ``WS_BANDED`` (see there).

Swap-AB as ``nvfp4_wgmma.py``: a program computes ``out^T`` tiles ``W (BLOCK_N weight rows) @ x^T
(BLOCK_K x BLOCK_M tokens)`` with fp32 accumulation. Unlike ``nvfp4_wgmma.py`` both operands come
from shared memory, so the decoded weights do not occupy the MMA warps' registers and the wgmma can
run asynchronously while the next stages are being filled:

* **producer partition** (``PRODUCER_WARPS`` warps, ``gl.warp_specialize`` worker): per K step it
  issues ``cp.async`` row gathers of the bf16 activation tile (``row_index`` fused; masked rows are
  zero-filled) into ring stage ``s`` and a ``cp.async.mbarrier.arrive.noinc`` on ``ready[s]``; loads
  the packed FP4 words and E4M3 block scales of the weight tile (one step ahead, in registers), decodes
  them exactly to bf16 ``e2m1 * scale * 2**-8`` (the same ``decode_words`` as every Gluon kernel of
  this family) in *memory* K order, stores them into the NVMMA-swizzled weight stage, fences the
  async proxy, and arrives once on ``ready[s]``. It waits on ``empty[s]`` before reusing a stage.
* **consumer partition** (the default partition, ``num_warps`` = 8 warps = two warpgroups, 64 weight
  rows each): waits on ``ready[s]``, issues ``wgmma`` (A = weight stage, B = activation stage
  transposed view) asynchronously, keeps one group in flight, and releases the previous stage on
  ``empty``. After the tile's last step: global scale x 2**8, SwiGLU + clamp, bf16 stores
  (``store_epilogue``, identical to ``nvfp4_wgmma.py``).

Exactness: the decode is bit-exact (same instructions); products are the same bf16 x bf16 values,
accumulated in fp32 by wgmma. The K order differs from ``nvfp4_wgmma.py`` (memory order here, the
"kappa" permutation there), so the fp32 summation order inside each 16-wide wgmma K chunk and across
chunks differs: results agree to fp32 rounding, not bit for bit.

Schedule: persistent over (m-tile, n-tile) items (m-tile major), every partition builds the same
per-expert tile table from ``expert_offsets`` in registers (as ``nvfp4_wgmma.py``; no host sync,
graph-capturable); ``row_lo`` / ``own_pad`` bands as there. Grouped only.

Debugging aid: ``MEGAMOE_WGMMA_WS_FLAT=1`` (read at launch) runs the same shared-memory pipeline
without warp specialization (all warps: cp.async x, decode to smem, synchronous wgmma), so a wrong
result or hang on the GPU can be attributed to the decode/smem layout (flat also wrong) or to the
mbarrier protocol (flat right, WS wrong).
"""
from __future__ import annotations

import os

import torch
import triton

from .nvfp4_gemm import _num_sms
from .nvfp4_gluon_jit import GLUON_AVAILABLE, kernel_arguments

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .nvfp4_gluon_jit import (decode_words, grouped_tile_table, locate_tile, store_epilogue, store_plain_epilogue,
                                  word_bytes)

# (BLOCK_M token rows = the wgmma N, BLOCK_N weight rows (64 per consumer warpgroup), BLOCK_K, STAGES,
#  consumer warps, producer warps, producer registers per thread).
# Shared memory per stage: (BLOCK_M + BLOCK_N) * BLOCK_K * 2 bytes (48 KB at 256 / 128 / 64).
# Note: ptxas allocates every partition within 65536 / (32 * all warps) registers (168 at 12 warps, 128 at
# 16; the setmaxnreg values do not raise it), so BLOCK_M = 256 (128 fp32 accumulators per consumer thread)
# needs 12 warps; BLOCK_M = 128 affords 8 producer warps (half the decode per producer thread).
WS_CONFIG_LARGE = (256, 128, 64, 3, 8, 4, 96)
WS_CONFIG_SMALL = (128, 128, 64, 4, 8, 8, 96)
WS_CONFIG = WS_CONFIG_LARGE
# Alternatives for the lead's sweep (benchmarks/validate_wgmma_ws.py --sweep).
WS_CONFIGS = [WS_CONFIG_LARGE, WS_CONFIG_SMALL, (256, 128, 64, 4, 8, 4, 96), (128, 128, 64, 4, 8, 4, 96),
              (128, 128, 128, 3, 8, 4, 96)]
# Host rule (megamoe/ops/gemm.py, only when routing is switched on): grouped, average rows per expert at
# least this many (below it the banded mma/wgmma routes keep the small experts), K % 128 == 0.
WS_MIN_ROWS_PER_EXPERT = 128
# average rows per expert from which BLOCK_M = 256 tiles are chosen (an expert with r rows fills
# r / (BLOCK_M * ceil(r / BLOCK_M)) of its tiles: 384 rows fill 75% of 256-row tiles, 100% of 128-row ones)
WS_LARGE_TILE_ROWS = 512
FLAT_ENV = "MEGAMOE_WGMMA_WS_FLAT"
NO_TMA_ENV = "MEGAMOE_WGMMA_WS_NO_TMA"


def select_ws_config(num_rows: int, num_experts: int) -> tuple:
    """The launch config for T rows over E experts (host shapes only)."""
    return WS_CONFIG_LARGE if num_rows >= WS_LARGE_TILE_ROWS * num_experts else WS_CONFIG_SMALL


def ws_preferred(num_rows: int, num_experts: int | None, k: int) -> bool:
    """Host-shape rule for the WS route: grouped, >= WS_MIN_ROWS_PER_EXPERT rows per expert, K % 128 == 0."""
    return num_experts is not None and k % 128 == 0 and num_rows >= WS_MIN_ROWS_PER_EXPERT * num_experts


if GLUON_AVAILABLE:

    @gluon.jit
    def _tile_table(offsets_ptr, num_rows, num_experts, row_lo, own_pad, BLOCK_M: gl.constexpr,
                    BLOCK_E: gl.constexpr, NW: gl.constexpr):
        """:func:`grouped_tile_table` with the lanes spread over the threads in contiguous runs."""
        return grouped_tile_table(offsets_ptr, num_rows, num_experts, row_lo, None, own_pad, BLOCK_M, BLOCK_E,
                                  BLOCK_E // (32 * NW), NW)

    @gluon.jit
    def _locate(tile, lane, starts, ends, tiles, tile_ends, num_experts, BLOCK_M: gl.constexpr):
        """(row_start, row_end, is_real, expert as int64) of m-tile ``tile``."""
        row_start, row_end, expert = locate_tile(tile, lane, starts, ends, tiles, tile_ends, BLOCK_M)
        return row_start, row_end, expert < num_experts, gl.minimum(expert, num_experts - 1).to(gl.int64)

    @gluon.constexpr_function
    def _word_layout(BLOCK_K, NW, per_thread):
        """Blocked layout over (rows, BLOCK_K // 8 // 4 * per_thread ...): ``per_thread`` consecutive
        elements of a row per thread, BLOCK_K // 32 threads per row (16 bytes of FP4 per thread)."""
        tpr = BLOCK_K // 32
        return gl.BlockedLayout([1, per_thread], [32 // tpr, tpr], [NW, 1], [1, 0])

    @gluon.jit
    def _weight_pointers(w_ptr, scale_ptr, expert_c, n_start, N, stride_we, stride_wn, stride_se, stride_sn,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NW: gl.constexpr):
        w_layout: gl.constexpr = _word_layout(BLOCK_K, NW, 4)  # 4 int32 words = 32 K per thread
        s_layout: gl.constexpr = _word_layout(BLOCK_K, NW, 2)  # the 2 scale bytes of those 32 K
        w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
        w_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
        s_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        w_ptrs = w_ptr + expert_c * stride_we + w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
        s_ptrs = scale_ptr + expert_c * stride_se + s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
        return w_ptrs, s_ptrs

    @gluon.jit
    def _x_pointers(x_ptr, row_index_ptr, row_start, row_end, num_src_rows, stride_xm, BLOCK_M: gl.constexpr,
                    BLOCK_K: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, ERR_FLAG: gl.constexpr, NW: gl.constexpr):
        """bf16 pointers (BLOCK_M, BLOCK_K) of the step at K = 0, the row mask, and the count of
        out-of-range ``row_index`` values in the tile (masked: those rows read zeros)."""
        tpr: gl.constexpr = BLOCK_K // 8
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpr, tpr], [NW, 1], [1, 0])
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        row_mask = rows < row_end
        bad = 0
        if HAS_ROW_INDEX:
            src = gl.load(row_index_ptr + rows, mask=row_mask, other=0).to(gl.int64)
            if ERR_FLAG != 0:
                ok = (src >= 0) & (src < num_src_rows)
                bad = gl.sum((row_mask & ~ok).to(gl.int32), axis=0)
                row_mask = row_mask & ok
                src = gl.where(ok, src, 0)
        else:
            src = rows.to(gl.int64)
        xb = x_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)  # x arrives as int32 bf16 pairs
        cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
        return xb + src[:, None] * (2 * stride_xm) + cols[None, :], row_mask, bad

    @gluon.jit
    def _decode_to_smem(words, scale_bytes, dst, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """Weight words (BLOCK_N, BLOCK_K//8) + scale bytes -> bf16 ``e2m1 * scale * 2**-8`` in memory K
        order, stored into the (NVMMA-swizzled) shared-memory tile ``dst``."""
        factor = scale_bytes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622794e35
        factor = gl.join(factor, factor)
        factor = gl.join(factor, factor)
        factor = gl.join(factor, factor).reshape([BLOCK_N, BLOCK_K // 2])  # one per packed byte
        packed = word_bytes(words)
        lo, hi = decode_words(packed, gl.convert_layout(factor, packed.type.layout))
        dst.store(gl.join(lo, hi).reshape([BLOCK_N, BLOCK_K]))  # element 2i = low nibble of byte i

    @gluon.jit
    def _producer(x_ptr, row_index_ptr, w_ptr, scale_ptr, offsets_ptr, err_ptr, x_desc, w_ring, x_ring, ready, empty,
                  num_rows, N, K, num_experts, num_src_rows, num_programs, row_lo, own_pad,
                  stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                  STAGES: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, ERR_FLAG: gl.constexpr, X_TMA: gl.constexpr,
                  NW: gl.constexpr):
        lane, starts, ends, tiles, tile_ends, total_tiles = _tile_table(offsets_ptr, num_rows, num_experts, row_lo,
                                                                        own_pad, BLOCK_M, BLOCK_E, NW)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        total_work = total_tiles * n_tiles
        k_tiles = K // BLOCK_K
        bad_rows = 0
        it = 0
        work = gl.program_id(0)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            row_start, row_end, is_real, expert_c = _locate(tile, lane, starts, ends, tiles, tile_ends, num_experts,
                                                            BLOCK_M)
            w_ptrs, s_ptrs = _weight_pointers(w_ptr, scale_ptr, expert_c, n_start, N, stride_we, stride_wn,
                                              stride_se, stride_sn, BLOCK_N, BLOCK_K, NW)
            x_ptrs, row_mask, bad = _x_pointers(x_ptr, row_index_ptr, row_start, row_end, num_src_rows, stride_xm,
                                                BLOCK_M, BLOCK_K, HAS_ROW_INDEX, ERR_FLAG, NW)
            k_steps = gl.where(is_real, k_tiles, 0)
            bad_rows += gl.where(is_real, bad, 0)
            last = gl.maximum(k_steps - 1, 0) * BLOCK_K
            words = gl.load(w_ptrs)
            scale_bytes = gl.load(s_ptrs)
            for step in range(0, k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # the first pass finds stages free
                if X_TMA:  # contiguous rows: one TMA box (rows past row_end are computed and never stored)
                    mbarrier.expect(ready.index(s), BLOCK_M * BLOCK_K * 2)
                    tma.async_copy_global_to_shared(x_desc, [row_start, step * BLOCK_K], ready.index(s),
                                                    x_ring.index(s))
                else:
                    async_copy.async_copy_global_to_shared(x_ring.index(s), x_ptrs + step * BLOCK_K,
                                                           mask=row_mask[:, None])
                    async_copy.commit_group()
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)  # per thread, when landed
                nxt = gl.minimum((step + 1) * BLOCK_K, last)
                words_n = gl.load(w_ptrs + nxt // 8)
                scale_n = gl.load(s_ptrs + nxt // 16)
                _decode_to_smem(words, scale_bytes, w_ring.index(s), BLOCK_N, BLOCK_K)
                fence_async_shared()
                gl.thread_barrier()  # every producer thread's stores are fenced before the single arrive
                mbarrier.arrive(ready.index(s))
                words, scale_bytes = words_n, scale_n
                it += 1
            work += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)

    @gluon.jit
    def _consumer(offsets_ptr, global_scale_ptr, bias_ptr, out_ptr, w_ring, x_ring, ready, empty,
                  num_rows, N, K, num_experts, swiglu_limit, num_programs, row_lo, own_pad,
                  stride_ge, stride_gn, stride_om,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                  STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
                  NW: gl.constexpr):
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        lane, starts, ends, tiles, tile_ends, total_tiles = _tile_table(offsets_ptr, num_rows, num_experts, row_lo,
                                                                        own_pad, BLOCK_M, BLOCK_E, NW)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        total_work = total_tiles * n_tiles
        k_tiles = K // BLOCK_K
        it = 0
        work = gl.program_id(0)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            row_start, row_end, is_real, expert_c = _locate(tile, lane, starts, ends, tiles, tile_ends, num_experts,
                                                            BLOCK_M)
            k_steps = gl.where(is_real, k_tiles, 0)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            for step in range(0, k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                fence_async_shared()  # the generic-proxy writes (cp.async, st.shared) seen, before wgmma reads them
                acc = warpgroup_mma(w_ring.index(s), x_ring.index(s).permute([1, 0]), acc, is_async=True)
                # at most this step's wgmma in flight: the previous step's stage is read
                acc, _w, _x = warpgroup_mma_wait(1, deps=[acc, w_ring.index(s), x_ring.index(s)])
                gl.thread_barrier()  # both warpgroups
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=step > 0)
                it += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k_steps > 0)
            if SWIGLU:
                store_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                               stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS,
                               SWIGLU, HAS_LIMIT, NW)
            else:
                store_plain_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c,
                                     stride_ge, stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)
            work += num_programs

    @gluon.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows", "row_lo", "own_pad"])
    def _nvfp4_wgmma_ws_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, row_lo, own_pad,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om, x_desc,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr,
        STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FLAT: gl.constexpr,
        X_TMA: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Grouped NVFP4 GEMM: decode-to-smem producer warps + async-wgmma consumer warpgroups (see module)."""
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * BLOCK_K), element_bitwidth=16,
                                                         rank=2)  # as _smem_layout (the TMA descriptor's)
        w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], smem_layout)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], smem_layout)
        if FLAT:
            _flat_body(x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr,
                       err_ptr, w_ring, x_ring, num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs,
                       row_lo, own_pad, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                       stride_om, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT,
                       ERR_FLAG, num_warps)
        else:
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                if X_TMA:  # the expect-tx arrive + the decode arrive
                    mbarrier.init(ready.index(i), count=2)
                else:  # every producer thread's cp.async arrive (noinc) + the decode arrive
                    mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS + 1)
                mbarrier.init(empty.index(i), count=1)
            fence_async_shared()
            gl.warp_specialize([
                (_consumer, (offsets_ptr, global_scale_ptr, bias_ptr, out_ptr, w_ring, x_ring, ready, empty,
                             num_rows, N, K, num_experts, swiglu_limit, num_programs, row_lo, own_pad,
                             stride_ge, stride_gn, stride_om, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, STAGES, HAS_BIAS,
                             SWIGLU, HAS_LIMIT, num_warps)),
                (_producer, (x_ptr, row_index_ptr, w_ptr, scale_ptr, offsets_ptr, err_ptr, x_desc, w_ring, x_ring,
                             ready, empty, num_rows, N, K, num_experts, num_src_rows, num_programs, row_lo, own_pad,
                             stride_xm, stride_we, stride_wn, stride_se, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K,
                             BLOCK_E, STAGES, HAS_ROW_INDEX, ERR_FLAG, X_TMA, PRODUCER_WARPS)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])

    @gluon.jit
    def _flat_body(x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
                   w_ring, x_ring, num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, row_lo,
                   own_pad, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
                   HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr,
                   HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, NW: gl.constexpr):
        """The debugging variant: the same smem tiles and helpers, no warp specialization, no mbarriers
        (stage 0 only; cp.async + wait, decode, barrier, synchronous wgmma, barrier)."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        lane, starts, ends, tiles, tile_ends, total_tiles = _tile_table(offsets_ptr, num_rows, num_experts, row_lo,
                                                                        own_pad, BLOCK_M, BLOCK_E, NW)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        total_work = total_tiles * n_tiles
        k_tiles = K // BLOCK_K
        bad_rows = 0
        work = gl.program_id(0)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            row_start, row_end, is_real, expert_c = _locate(tile, lane, starts, ends, tiles, tile_ends, num_experts,
                                                            BLOCK_M)
            w_ptrs, s_ptrs = _weight_pointers(w_ptr, scale_ptr, expert_c, n_start, N, stride_we, stride_wn,
                                              stride_se, stride_sn, BLOCK_N, BLOCK_K, NW)
            x_ptrs, row_mask, bad = _x_pointers(x_ptr, row_index_ptr, row_start, row_end, num_src_rows, stride_xm,
                                                BLOCK_M, BLOCK_K, HAS_ROW_INDEX, ERR_FLAG, NW)
            k_steps = gl.where(is_real, k_tiles, 0)
            bad_rows += gl.where(is_real, bad, 0)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            for step in range(0, k_steps):
                async_copy.async_copy_global_to_shared(x_ring.index(0), x_ptrs + step * BLOCK_K, mask=row_mask[:, None])
                async_copy.commit_group()
                words = gl.load(w_ptrs + step * (BLOCK_K // 8))
                scale_bytes = gl.load(s_ptrs + step * (BLOCK_K // 16))
                _decode_to_smem(words, scale_bytes, w_ring.index(0), BLOCK_N, BLOCK_K)
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                acc = warpgroup_mma(w_ring.index(0), x_ring.index(0).permute([1, 0]), acc)
                gl.thread_barrier()  # the synchronous wgmma of every warpgroup has read the tiles
            if SWIGLU:
                store_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                               stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS,
                               SWIGLU, HAS_LIMIT, NW)
            else:
                store_plain_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c,
                                     stride_ge, stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)
            work += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)


def _flat_requested() -> bool:
    return os.environ.get(FLAT_ENV, "0") not in ("", "0")


def _smem_layout(block_k: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * block_k), element_bitwidth=16, rank=2)


def compile_for_sm90(config=WS_CONFIG, *, flat=False, row_index=True, x_tma=None, bias=False, swiglu=False,
                     swiglu_limit=True):
    """Compile the kernel for sm_90 without a GPU (tests, offline SASS); ``config`` as the launcher's;
    ``x_tma`` as the launcher's (default: TMA for contiguous rows, unless ``flat``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .nvfp4_gluon_jit import ALIGNED_ARGS, POINTER_ARGS, _device_guard

    block_m, block_n, block_k, stages, num_warps, producer_warps, producer_regs = config
    x_tma = (not row_index and not flat) if x_tma is None else x_tma
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=512, GROUPED=True,
                     HAS_ROW_INDEX=row_index, HAS_BIAS=bias, SWIGLU=swiglu, HAS_LIMIT=swiglu_limit,
                     ERR_FLAG=1 if _device_guard() else 0, STAGES=stages, PRODUCER_WARPS=producer_warps,
                     PRODUCER_REGS=producer_regs, FLAT=flat, X_TMA=x_tma, num_warps=num_warps)
    scalars = ["num_rows", "N", "K", "num_experts", "num_src_rows", "num_programs", "row_lo", "own_pad", "stride_xm",
               "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om"]
    desc = f"tensordesc<bf16[{block_m},{block_k}],{_smem_layout(block_k)!r}>"
    signature = dict(POINTER_ARGS, **{name: "i32" for name in scalars}, swiglu_limit="fp32", x_desc=desc,
                     **{name: "constexpr" for name in constants})
    kernel = _nvfp4_wgmma_ws_kernel
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED_ARGS}
    source = GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def launch_nvfp4_wgmma_ws(
    x: torch.Tensor,
    data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
    interpreter: bool = False,
    config=None,
    error_word: torch.Tensor | None = None,
    row_lo: int = 0,
    own_pad: bool = True,
    flat: bool | None = None,
    x_tma: bool | None = None,
) -> torch.Tensor:
    """Launch the warp-specialized Gluon wgmma NVFP4 grouped GEMM (same contract as
    :func:`megamoe.kernels.gemm.nvfp4_wgmma.launch_nvfp4_wgmma`, grouped only).

    x: (S, K) bf16 (row-major, 16-byte aligned rows); data (E, N, K//2) uint8; block_scale
    (E, N, K//16) e4m3; global_scale fp32 0-d / (E, 1, 1) / (E, N, 1); expert_offsets (E,) int32 on the
    device; out (T, N) bf16 or (T, N//2) with ``swiglu``. ``config``: (BLOCK_M, BLOCK_N, BLOCK_K,
    STAGES, consumer warps, producer warps, producer registers). ``flat``: the non-warp-specialized
    debugging variant (default: the ``MEGAMOE_WGMMA_WS_FLAT`` environment flag). ``x_tma``: load the
    activation tiles with TMA (only without ``row_index``; default: then, unless flat or
    ``MEGAMOE_WGMMA_WS_NO_TMA=1``); otherwise cp.async row gathers.
    """
    if interpreter:
        raise ValueError("interpreter: the Gluon kernels run on sm_90 GPUs only")
    if expert_offsets is None:
        raise ValueError("expert_offsets: the warp-specialized kernel is grouped only")
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0]
    if num_rows == 0 or n == 0:
        return out
    block_m, block_n, block_k, stages, num_warps, producer_warps, producer_regs = (
        config or select_ws_config(num_rows, num_experts))
    if k % block_k:
        raise ValueError(f"data: K={k} must be a multiple of BLOCK_K={block_k} for this kernel")
    if block_n != 16 * num_warps:
        raise ValueError(f"config: BLOCK_N={block_n} must be 16 * num_warps={16 * num_warps}")
    flat = _flat_requested() if flat is None else flat
    if x_tma is None:
        x_tma = row_index is None and not flat and os.environ.get(NO_TMA_ENV, "0") in ("", "0")
    if x_tma and (row_index is not None or flat):
        raise ValueError("x_tma: TMA activation tiles need contiguous rows (no row_index) and the WS kernel")
    m_tiles_bound = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows // (row_lo + 1)) + 1
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    programs = min(work_bound, _num_sms(x.device.index or 0))
    head, strides, flags = kernel_arguments(x, data, block_scale, global_scale, out, expert_offsets=expert_offsets,
                                            row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                                            error_word=error_word)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # built on every launch (host metadata only; a captured graph keeps the descriptor of x's buffer)
    x_src = x if x.shape[0] else x.new_zeros(1, k)  # (a descriptor needs rows; unused without x_tma)
    x_desc = TensorDescriptor.from_tensor(x_src, [block_m, block_k], _smem_layout(block_k))
    _nvfp4_wgmma_ws_kernel[(programs,)](
        *head, programs, row_lo, int(own_pad), *strides, x_desc, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts + 1)), STAGES=stages,
        PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, FLAT=flat, X_TMA=x_tma, num_warps=num_warps,
        **flags,
    )
    return out
