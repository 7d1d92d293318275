"""Prefill-shaped NVFP4 x bf16 grouped GEMM on Hopper, shaped like the peer's (Gluon, async ``wgmma`` chain).

One kernel, one launcher (:func:`launch_nvfp4_wgmma_pipe`). Issue 10; design, prediction and outcome in
``benchmarks/NOTES_gemm.md`` (v17).

Swap-AB as ``nvfp4_wgmma.py``: a program computes ``out^T`` tiles ``W (BLOCK_N = 256 weight rows) @ x^T
(BLOCK_K x BLOCK_M tokens)`` with fp32 accumulation; each of the two warpgroups owns two m64 tiles of weight
rows (128 accumulator registers per thread). What differs from ``nvfp4_wgmma.py``:

* **One shared-memory ring for everything a K step reads** (``STAGES`` slots, ``STAGES - 2`` steps in flight):
  the x tile (rows gathered by ``row_index``, already in the MMA K order: ``megamoe.format.mma_order``), the
  packed FP4 words and the E4M3 scale bytes of the weight tile, all by 16-byte (scales: 8-byte) ``cp.async``.
  The weights come back with one 16-byte shared load per row and step instead of a global load one step ahead.
* **A fine-grained asynchronous wgmma chain:** each 128-K step is four 32-K sub-steps; sub-step ``i`` decodes
  word ``i`` of every lane's 16 bytes (exactly the A fragments of MMA K slices ``2i`` and ``2i + 1``: the
  "kappa" order of ``nvfp4_gluon_jit``) into 16 registers and issues its wgmma (two m64 x BLOCK_M x 32 per
  warpgroup) without waiting for it; only the sub-step before is waited for. So the decode of sub-step
  ``i + 1`` overlaps the tensor core's work on ``i``, and the A registers live at once are 32 per thread,
  which is what leaves room for the 256-row tile (the whole-step A, double-buffered as ``nvfp4_wgmma.py``
  does it, would need 128).

Exactness: the decode is bit-exact (the family's ``decode_words``); the products are the same bf16 x bf16
values as ``nvfp4_wgmma.py`` in the same K order, accumulated in fp32 by wgmma in 32-K instead of 128-K
groups: results agree with it to fp32 summation rounding (the CUDA tests bound it against float32).

Schedule, bands and padding as ``nvfp4_wgmma.py`` (persistent, per-expert tile table built in registers from
``expert_offsets``, no host sync, graph-capturable). Grouped only. Requirements: sm_90, K % 256 == 0
(:func:`pipe_supported`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...format.mma_order import MMA_K_GROUP
from ..pdl import gl_launch_dependents, gl_wait_for_previous_grid, pdl_supported
from .mma_k_order import launch_to_mma_k_order
from .nvfp4_gemm import _num_sms, expert_row_ranges
from .nvfp4_gluon_jit import GLUON_AVAILABLE, check_weight_interleave, compile_sm90, kernel_arguments
from .nvfp4_mma_decode import ROW_HI_UNBOUNDED

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    from .nvfp4_gluon_jit import (decode_words, grouped_tile_table, interleaved_row_offsets, locate_tile,
                                  scale_layout, store_epilogue, store_plain_epilogue, tile_row_pointers,
                                  weight_layout, word_bytes)

# (BLOCK_M token rows = the wgmma N, BLOCK_N weight rows, BLOCK_K, num_warps, STAGES).
# Shared memory: STAGES * (BLOCK_M * BLOCK_K * 2 + BLOCK_N * BLOCK_K * 9 / 16) bytes (200 KB at the default).
# MEGAMOE_PIPE_CONFIG="BLOCK_M,BLOCK_N,BLOCK_K,num_warps,STAGES" (read at import) overrides it for sweeps.
PIPE_CONFIG = tuple(int(v) for v in os.environ.get("MEGAMOE_PIPE_CONFIG", "128,256,128,8,4").split(","))
# Band configs (megamoe.ops.gemm.plan_row_bands with PIPE_BANDS): the smallest BLOCK_M that holds the band's
# experts in one tile; deeper rings where the x tile is small (offline sm_90: 180-244 registers, no spills,
# 3.5 SASS per weight in the K loop).
PIPE_BAND_CONFIGS = {32: (32, 256, 128, 8, 6), 64: (64, 256, 128, 8, 4)}
# The 64-row band with 128-column tiles, one warpgroup, two programs per SM (offline sm_90: 254-255 registers, no
# spills; 4 x 25 KB of ring): twice the programs per expert, for decode-sized plans where a few hot experts run this
# band alone (megamoe.ops.gemm.PIPE_ABOVE_MMA_ROWS below PIPE_ABOVE_WIDE_N; H100, V4-Flash Zipf 64 tokens 0.967 ->
# 1.000x of the 32-row chunks, all-on-k 1.549 -> 1.568x: results/gpu_check_v35/ab_layer_settings_g_pipe_above_bn128.md).
PIPE_BAND64_NARROW_CONFIG = (64, 128, 128, 4, 4, 2)
# Tail-tile band configs (megamoe.ops.gemm.PIPE_TAIL): BLOCK_M the sum of two powers of two (split_tile_rows), so
# that experts of 65-96 rows fill 96-row (64 + 32) tiles instead of 128 (uniform V4-Flash routing at 4096 tokens puts
# ~half the experts there). Shared memory 4 x 42 KB. Kernel alone (H100, gpu_check_v23/ab_pipe_tail.md, 96 rows per
# expert): 1.12x (gate_up) / 1.22x (down) faster than the 128-row tile, the same bits. A 48-row (32 + 16) tile for
# 33-48 rows compiles and is tested, but was 0.96-0.97x of the 64-row tile there: not a band.
PIPE_TAIL_CONFIGS = {96: (96, 256, 128, 8, 4)}
# The row bands (lo, hi] -> config that PIPE_TAIL adds to PIPE_BAND_CONFIGS (keyed by hi, as there): 65-96 rows in
# one 96-row tile, 97-128 in one 128-row tile, 129-192 in two 96-row tiles (two 128-row tiles would be 50-75% rows).
PIPE_TAIL_BANDS = {96: PIPE_TAIL_CONFIGS[96], 128: PIPE_CONFIG, 192: PIPE_TAIL_CONFIGS[96]}
PIPE_BM48_CONFIG = (48, 256, 128, 8, 6)
PIPE_BM16_CONFIG = (16, 256, 128, 8, 6)  # compiles (161 registers) and is tested, but slower than mma.sync's 16
# One warpgroup, 128 weight rows, two programs per SM (174 / 215 registers x 128 threads, 104 / 102 KB of ring):
# two independent rings per SM for the memory-bound small-row bands (megamoe.ops.gemm.PIPE_SMALL, NOTES_gemm.md
# v17: 1.04-1.15x at 512-1024 tokens of V4-Flash / V4-Pro; the same for the 64-row band measured equal). The 16-row
# band keeps 6 steps in flight (8 stages; NOTES_gemm.md v21: 1.02-1.06x over 6 stages, kernel alone at 512 tokens,
# the same bits); three programs per SM (5 stages, maxnreg 168), 8-row tiles, wait depth 2 / 3 and one 32-row band
# for all <= 32-row experts were measured slower or equal there.
PIPE_SMALL_CONFIGS = {16: (16, 128, 128, 4, 8, 2), 32: (32, 128, 128, 4, 6, 2)}
# The bands above 32 rows as device-built tile lists (``tile_list``; NOTES_gemm.md v24), each walked by one persistent
# grid, instead of one launch per band (each ending in a partial wave). The row edges of the tile kinds, the band
# plan's above 32 rows: <= 64 rows one 64-row tile (PIPE_BAND_CONFIGS[64]), <= 96 one 96-row (64 + 32) tile and <= 128
# one 128-row tile (PIPE_TAIL_BANDS), <= 192 two 96-row tiles, then 128-row tiles. List A (128- and 64-row tiles)
# runs PIPE_CONFIG's ring (4 stages, 200 KB), its 64-row tiles in the first 64 rows of each x slot; list B (96-row
# tiles) the 96-row band config's rings. Every tile is computed as its band computes it (the same bits).
PIPE_LIST_EDGES = (64, 96, 128, 192)
# List B's kernel starts on the SMs that list A's programs free (programmatic dependent launch; the list kernel's
# OVERLAP) instead of after list A's last program: env MEGAMOE_PIPE_LIST_OVERLAP (read at import), "1" (default) on.
PIPE_LIST_OVERLAP = os.environ.get("MEGAMOE_PIPE_LIST_OVERLAP", "1").strip() not in ("", "0")
SUB_K = 32  # K per wgmma of the chain: one packed word per lane
# Sub-steps (each 4 wgmmas: 2 m64 tiles x 2 k16) left in flight when the next one is decoded: 1 (default) waits for
# the one before; 2 / 3 keep one / two more A operand sets live (16 registers each). Offline sm_90 (2026-11-26): all
# three keep 255 registers with no spill in the K loop (stack 56 / 72 / 88 B outside it), DEPBAR.LE gsb0 0x1 / 0x2 /
# 0x3, 3.68 / 3.68 / 3.63 SASS per weight; the same MMAs in the same order, so the same bits. Env
# MEGAMOE_PIPE_WAIT_DEPTH (read at import) or the launcher's ``wait_depth`` for A/B runs. Measured (H100, two runs,
# results/gpu_check_v22): depth 3 / depth 1 = 0.97-1.01 on V4-Flash at 4096 tokens, within the run-to-run spread.
PIPE_WAIT_DEPTH = int(os.environ.get("MEGAMOE_PIPE_WAIT_DEPTH", "1") or 1)
_SUB_K = gl.constexpr(SUB_K) if GLUON_AVAILABLE else SUB_K


if GLUON_AVAILABLE:

    @gluon.jit
    def _decode_sub(words, scale_bytes, i: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """Sub-step ``i`` of a 128-K step: word ``i`` of each lane's four (memory K ``32 q + 8 i ..``) and its
        block scale -> the A operand (BLOCK_N, 32) bf16 ``e2m1 * scale * 2**-8`` in MMA K order
        ``c0 + 2q + 8c1 + 16nib`` (the kappa order of ``decode_a_operand`` restricted to ``i``)."""
        quads = words.reshape([BLOCK_N, 4, 2, 2])  # n, q, i >> 1, i & 1
        even, odd = gl.split(quads)
        half = odd if i % 2 == 1 else even
        low, high = gl.split(half)
        word = high if i // 2 == 1 else low  # (BLOCK_N, 4): one word per quad lane
        sq = scale_bytes.reshape([BLOCK_N, 4, 2])  # n, q, block of the lane's two
        s0, s1 = gl.split(sq)
        scale = s1 if i // 2 == 1 else s0
        factor = scale.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622794e35  # * 2**118
        factor = gl.join(factor, factor)
        factor = gl.join(factor, factor).reshape([BLOCK_N, 16])
        packed = word_bytes(word)
        lo, hi = decode_words(packed, gl.convert_layout(factor, packed.type.layout))
        w = gl.join(lo, hi).reshape([BLOCK_N, 4, 2, 2, 2])  # n, q, c1, c0, nib
        w = w.permute([0, 4, 2, 1, 3]).reshape([BLOCK_N, 32])  # n, nib, c1, q, c0
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def _slot(ring, slot, ROW0: gl.constexpr, ROWS: gl.constexpr):
        """Ring slot ``slot`` of an x ring: the whole slot (``ROWS`` 0), or its rows ``[ROW0, ROW0 + ROWS)`` (the
        tile-list kernel's shorter tiles in its 128-row slots; a 3-D ring cannot be sliced along rows itself)."""
        view = ring.index(slot)
        if ROWS > 0:
            view = view.slice(ROW0, ROWS, dim=0)
        return view

    @gluon.jit
    def _fill(x_ring, w_ring, s_ring, slot, xr_ptrs, xr_mask, wr_ptrs, sr_ptrs, step, xt_ring, xt_ptrs, xt_mask,
              BLOCK_K: gl.constexpr, BLOCK_M_TAIL: gl.constexpr, W_IL: gl.constexpr = 1, X_ROW0: gl.constexpr = 0,
              X_ROWS: gl.constexpr = 0, T_ROW0: gl.constexpr = 0, T_ROWS: gl.constexpr = 0):
        """cp.async of K step ``step``'s x (head rows, and the tail rows into ``xt_ring`` when BLOCK_M_TAIL > 0),
        weight words and scale bytes into ring ``slot`` (x rows where the mask is False, i.e. out-of-range
        ``row_index`` values, are zero-filled: the reference's drop rule)."""
        async_copy.async_copy_global_to_shared(_slot(x_ring, slot, X_ROW0, X_ROWS), xr_ptrs + step * BLOCK_K,
                                               mask=xr_mask)
        if BLOCK_M_TAIL > 0:
            async_copy.async_copy_global_to_shared(_slot(xt_ring, slot, T_ROW0, T_ROWS), xt_ptrs + step * BLOCK_K,
                                                   mask=xt_mask)
        async_copy.async_copy_global_to_shared(w_ring.index(slot), wr_ptrs + step * (W_IL * BLOCK_K // 8))
        async_copy.async_copy_global_to_shared(s_ring.index(slot), sr_ptrs + step * (W_IL * BLOCK_K // 16))

    @gluon.jit
    def _k_step(acc, acc_t, a_prev, a_prev2, a_prev3, x_ring, w_ring, s_ring, xr_ptrs, xr_mask, wr_ptrs, sr_ptrs,
                xt_ring, xt_ptrs, xt_mask, step, k_tiles, a_layout: gl.constexpr, at_layout: gl.constexpr,
                w_layout: gl.constexpr, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, WAIT_DEPTH: gl.constexpr, BLOCK_M_TAIL: gl.constexpr, W_IL: gl.constexpr = 1,
                X_ROW0: gl.constexpr = 0, X_ROWS: gl.constexpr = 0, T_ROW0: gl.constexpr = 0, T_ROWS: gl.constexpr = 0):
        """One 128-K step: wait for its ring slot, refill the slot of step - 2 with step + STAGES - 2, then four
        32-K sub-steps (decode, async wgmma, wait until at most WAIT_DEPTH sub-steps are in flight). With
        BLOCK_M_TAIL > 0 each sub-step's decoded A also feeds a second wgmma into ``acc_t`` (the tile's tail
        rows, from ``xt_ring``); otherwise ``acc_t`` is passed through untouched. Returns (acc, acc_t, the A
        operands of the last three sub-steps, newest first: those still in flight stay live; with WAIT_DEPTH 1
        the last two are passed through untouched)."""
        slot = step % STAGES
        async_copy.wait_group(STAGES - 3)  # this thread's copies of `step` have landed
        # the compiler's barrier after the wait: everyone's have, and every warpgroup's MMAs of step - 2 (waited
        # for in step - 1) are complete
        words = w_ring.index(slot).load(w_layout)
        scale_bytes = s_ring.index(slot).load(s_layout)
        xs = _slot(x_ring, slot, X_ROW0, X_ROWS)
        xts = _slot(xt_ring, slot, T_ROW0, T_ROWS)
        ahead = step + STAGES - 2  # its slot was read by the MMAs of step - 2
        if ahead < k_tiles:
            _fill(x_ring, w_ring, s_ring, ahead % STAGES, xr_ptrs, xr_mask, wr_ptrs, sr_ptrs, ahead, xt_ring, xt_ptrs,
                  xt_mask, BLOCK_K, BLOCK_M_TAIL, W_IL, X_ROW0, X_ROWS, T_ROW0, T_ROWS)
        async_copy.commit_group()
        for i in gl.static_range(BLOCK_K // _SUB_K):
            a = _decode_sub(words, scale_bytes, i, a_layout, BLOCK_N)
            acc = warpgroup_mma(a, xs.slice(_SUB_K * i, _SUB_K, dim=1).permute([1, 0]), acc, is_async=True)
            if BLOCK_M_TAIL > 0:
                # the same A registers (a layout conversion between equal linear layouts: no instructions)
                acc_t = warpgroup_mma(gl.convert_layout(a, at_layout),
                                      xts.slice(_SUB_K * i, _SUB_K, dim=1).permute([1, 0]), acc_t, is_async=True)
                # two commit groups per sub-step: "the sub-step before is complete" is at most 2 groups pending
                acc, acc_t, a_prev = warpgroup_mma_wait(2, deps=[acc, acc_t, a_prev])
            elif WAIT_DEPTH == 1:
                acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
            elif WAIT_DEPTH == 2:
                acc, a_prev2 = warpgroup_mma_wait(2, deps=[acc, a_prev2])
                a_prev2 = a_prev
            else:
                acc, a_prev3 = warpgroup_mma_wait(3, deps=[acc, a_prev3])
                a_prev3 = a_prev2
                a_prev2 = a_prev
            a_prev = a
        return acc, acc_t, a_prev, a_prev2, a_prev3

    @gluon.jit
    def _store_zeros(out_ptr, row_start, row_end, n_start, N, stride_om, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, SWIGLU: gl.constexpr, num_warps: gl.constexpr):
        """Zeros into a padding tile's output (rows ``[row_start, row_end)``, this n-tile's columns)."""
        width: gl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
        n_out = N // 2 if SWIGLU else N
        col0 = n_start // 2 if SWIGLU else n_start
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
        zeros = gl.zeros([BLOCK_M, width], gl.bfloat16, layout=layout)
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], zeros,
                 mask=(rows < row_end)[:, None] & (cols < n_out)[None, :])

    @gluon.jit
    def _store_tile(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge, stride_gn,
                    bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, num_warps: gl.constexpr):
        """The epilogue of one accumulator (BLOCK_N weight rows x BLOCK_M token rows from ``row_start``)."""
        if SWIGLU:
            store_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                           stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, SWIGLU,
                           HAS_LIMIT, num_warps)
        else:
            store_plain_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                                 stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)

    @gluon.jit
    def _pipe_tile(x_bf16, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, x_ring, xt_ring,
                   w_ring, s_ring, row_start, row_end, expert, n_start, N, K, num_experts, num_src_rows,
                   swiglu_limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                   stride_om, BLOCK_M: gl.constexpr, BLOCK_M_TAIL: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
                   SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, num_warps: gl.constexpr,
                   STAGES: gl.constexpr, WAIT_DEPTH: gl.constexpr, W_IL: gl.constexpr, X_ROW0: gl.constexpr = 0,
                   X_ROWS: gl.constexpr = 0, T_ROW0: gl.constexpr = 0, T_ROWS: gl.constexpr = 0):
        """One tile: token rows ``[row_start, row_start + BLOCK_M + BLOCK_M_TAIL)`` (those below ``row_end``) of
        ``expert`` (``num_experts`` and up: padding, zeros without weight traffic) x weight rows ``[n_start,
        n_start + BLOCK_N)``, through the ring (``x_ring``: the head's ``[STAGES, BLOCK_M, BLOCK_K]`` x slots, or rows
        ``[X_ROW0, X_ROW0 + X_ROWS)`` of larger slots when X_ROWS > 0; ``xt_ring`` / T_ROW0 / T_ROWS: the tail's,
        read when BLOCK_M_TAIL > 0). Returns how many of its rows had a ``row_index`` value
        outside ``[0, num_src_rows)`` (0 when ERR_FLAG is 0)."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        MT: gl.constexpr = BLOCK_M_TAIL if BLOCK_M_TAIL > 0 else BLOCK_M
        mma_t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, MT, 16])
        at_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t_layout, k_width=2)
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        # copy layouts: 16-byte chunks of x (8 bf16) and of weight words (4 int32), one 8-byte chunk of scales
        xr_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [num_warps, 1],
                                                   [1, 0])
        wr_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BLOCK_K // 32), BLOCK_K // 32], [num_warps, 1],
                                                   [1, 0])
        sr_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 16], [32, 1], [num_warps, 1], [1, 0])
        xr_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xr_layout))
        wr_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, wr_layout))
        sr_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, sr_layout))
        k_tiles = K // BLOCK_K
        bad_rows = 0
        is_real = expert < num_experts
        expert_c = gl.minimum(expert, num_experts - 1).to(gl.int64)
        # weight rows past N read row N - 1 (never stored); x rows past the tile end read a valid row
        w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wr_layout)), N - 1)
        if W_IL > 1:  # rows interleaved in groups of W_IL; one 128-K step = one chunk, so the columns stay
            w_off = interleaved_row_offsets(w_rows, stride_wn, BLOCK_K // 8, W_IL)
            wr_ptrs = w_ptr + expert_c * stride_we + w_off[:, None] + wr_cols[None, :]
        else:
            wr_ptrs = w_ptr + expert_c * stride_we + w_rows.to(gl.int64)[:, None] * stride_wn + wr_cols[None, :]
        s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sr_layout)), N - 1)
        if W_IL > 1:
            s_off = interleaved_row_offsets(s_rows, stride_sn, BLOCK_K // 16, W_IL)
            sr_ptrs = scale_ptr + expert_c * stride_se + s_off[:, None] + sr_cols[None, :]
        else:
            sr_ptrs = (scale_ptr + expert_c * stride_se + s_rows.to(gl.int64)[:, None] * stride_sn
                       + sr_cols[None, :])
        if HAS_ROW_INDEX:
            xr_ptrs, xr_mask, bad = tile_row_pointers(x_bf16, row_index_ptr, row_start, row_end, is_real,
                                                      num_src_rows, 2 * stride_xm, xr_cols, BLOCK_M, xr_layout,
                                                      ERR_FLAG)
            bad_rows += bad
        else:
            r_rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xr_layout))
            xr_ptrs = x_bf16 + gl.where(r_rows < row_end, r_rows, 0).to(gl.int64)[:, None] * (2 * stride_xm) \
                + xr_cols[None, :]
            xr_mask = None
        if BLOCK_M_TAIL > 0:
            if HAS_ROW_INDEX:
                xt_ptrs, xt_mask, bad = tile_row_pointers(x_bf16, row_index_ptr, row_start + BLOCK_M, row_end,
                                                          is_real, num_src_rows, 2 * stride_xm, xr_cols, BLOCK_M_TAIL,
                                                          xr_layout, ERR_FLAG)
                bad_rows += bad
            else:
                t_rows = row_start + BLOCK_M + gl.arange(0, BLOCK_M_TAIL, layout=gl.SliceLayout(1, xr_layout))
                xt_ptrs = x_bf16 + gl.where(t_rows < row_end, t_rows, 0).to(gl.int64)[:, None] * (2 * stride_xm) \
                    + xr_cols[None, :]
                xt_mask = None
        else:
            xt_ptrs = xr_ptrs  # not read
            xt_mask = xr_mask
        if is_real:
            # (a path from the accumulator's zeroing to the final wait that skips every wgmma, e.g. a
            # zero-trip K loop, makes ptxas serialise all wgmmas: C7515)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            gl.thread_barrier()  # every warpgroup's MMAs of the previous tile have read the ring
            for j in gl.static_range(STAGES - 2):
                if j < k_tiles:
                    _fill(x_ring, w_ring, s_ring, j, xr_ptrs, xr_mask, wr_ptrs, sr_ptrs, j, xt_ring, xt_ptrs,
                          xt_mask, BLOCK_K, BLOCK_M_TAIL, W_IL, X_ROW0, X_ROWS, T_ROW0, T_ROWS)
                async_copy.commit_group()
            a_prev = gl.zeros([BLOCK_N, _SUB_K], gl.bfloat16, layout=a_layout)
            a_prev2 = a_prev
            a_prev3 = a_prev
            if BLOCK_M_TAIL > 0:
                acc_t = gl.zeros([BLOCK_N, BLOCK_M_TAIL], gl.float32, layout=mma_t_layout)
            else:
                acc_t = a_prev  # passed through untouched
            # step 0 peeled: every path from the zeroing to the final wait passes a wgmma
            acc, acc_t, a_prev, a_prev2, a_prev3 = _k_step(
                acc, acc_t, a_prev, a_prev2, a_prev3, x_ring, w_ring, s_ring, xr_ptrs, xr_mask, wr_ptrs, sr_ptrs,
                xt_ring, xt_ptrs, xt_mask, 0, k_tiles, a_layout, at_layout, w_layout, s_layout, BLOCK_N, BLOCK_K,
                STAGES, WAIT_DEPTH, BLOCK_M_TAIL, W_IL, X_ROW0, X_ROWS, T_ROW0, T_ROWS)
            for step in range(1, k_tiles):
                acc, acc_t, a_prev, a_prev2, a_prev3 = _k_step(
                    acc, acc_t, a_prev, a_prev2, a_prev3, x_ring, w_ring, s_ring, xr_ptrs, xr_mask, wr_ptrs,
                    sr_ptrs, xt_ring, xt_ptrs, xt_mask, step, k_tiles, a_layout, at_layout, w_layout, s_layout,
                    BLOCK_N, BLOCK_K, STAGES, WAIT_DEPTH, BLOCK_M_TAIL, W_IL, X_ROW0, X_ROWS, T_ROW0, T_ROWS)
            if BLOCK_M_TAIL > 0:
                acc, acc_t = warpgroup_mma_wait(0, deps=[acc, acc_t, a_prev])[:2]
            elif WAIT_DEPTH == 1:
                acc = warpgroup_mma_wait(0, deps=[acc, a_prev])[0]
            else:
                acc = warpgroup_mma_wait(0, deps=[acc, a_prev, a_prev2, a_prev3])[0]
            _store_tile(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                        stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, SWIGLU,
                        HAS_LIMIT, num_warps)
            if BLOCK_M_TAIL > 0:
                _store_tile(acc_t, row_start + BLOCK_M, row_end, is_real, n_start, N, global_scale_ptr, expert_c,
                            stride_ge, stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M_TAIL,
                            BLOCK_N, HAS_BIAS, SWIGLU, HAS_LIMIT, num_warps)
        else:
            _store_zeros(out_ptr, row_start, row_end, n_start, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU, num_warps)
            if BLOCK_M_TAIL > 0:
                _store_zeros(out_ptr, row_start + BLOCK_M, row_end, n_start, N, stride_om, BLOCK_M_TAIL, BLOCK_N,
                             SWIGLU, num_warps)
        return bad_rows

    @gluon.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows", "row_lo", "row_hi", "own_pad"])
    def _nvfp4_wgmma_pipe_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, row_lo, own_pad,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om, row_hi,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 4, WAIT_DEPTH: gl.constexpr = 1, BLOCK_M_TAIL: gl.constexpr = 0, W_IL: gl.constexpr = 1,
        AFTER_BAND: gl.constexpr = False,
    ):
        """Grouped NVFP4 GEMM, x in the MMA K order: one cp.async ring for x, weights and scales, and a
        32-K-grained async wgmma chain (module docstring). A tile holds BLOCK_M + BLOCK_M_TAIL token rows: the
        head (the wgmma N = BLOCK_M) and, when BLOCK_M_TAIL > 0, a tail of BLOCK_M_TAIL rows with its own ring
        part and accumulator, fed by the same decoded weights (tiles of 96 = 64 + 32 rows, say, where shapes
        must be powers of two). AFTER_BAND (launched with PDL; launcher ``after_band``): a later band of one banded
        GEMM, inputs final before the previous band started, rows disjoint from it: lets the next kernel launch at
        once, computes beside the previous band and waits for it only before exiting."""
        if AFTER_BAND:
            gl_launch_dependents()
        gl.static_assert(BLOCK_K == 128)
        gl.static_assert(STAGES >= 3)
        gl.static_assert(WAIT_DEPTH >= 1 and WAIT_DEPTH <= 3)
        gl.static_assert(BLOCK_M_TAIL == 0 or (WAIT_DEPTH == 1 and BLOCK_M_TAIL < BLOCK_M))
        TILE_M: gl.constexpr = BLOCK_M + BLOCK_M_TAIL
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        flat_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], x_smem_layout)
        if BLOCK_M_TAIL > 0:
            xt_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M_TAIL, BLOCK_K], x_smem_layout)
        else:
            xt_ring = x_ring  # not read
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], flat_layout)
        s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], flat_layout)
        x_bf16 = x_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        # per-expert tiles of the band row_lo < rows <= row_hi (lane E: the padding pseudo-expert, with own_pad)
        lane, starts, ends, tiles, tile_ends, total_tiles = grouped_tile_table(
            offsets_ptr, num_rows, num_experts, row_lo, row_hi, own_pad, TILE_M, BLOCK_E, 1, num_warps)
        total_work = total_tiles * n_tiles

        work = gl.program_id(0)
        bad_rows = 0  # row_index values outside [0, num_src_rows) (flagged once)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            row_start, row_end, expert = locate_tile(tile, lane, starts, ends, tiles, tile_ends, TILE_M)
            bad_rows += _pipe_tile(
                x_bf16, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, x_ring, xt_ring, w_ring,
                s_ring, row_start, row_end, expert, n_start, N, K, num_experts, num_src_rows, swiglu_limit, stride_xm,
                stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om, BLOCK_M, BLOCK_M_TAIL,
                BLOCK_N, BLOCK_K, HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT, ERR_FLAG, num_warps, STAGES,
                WAIT_DEPTH, W_IL)
            work += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)
        if AFTER_BAND:  # complete only after the previous band (the stream's next kernel waits for this one)
            gl_wait_for_previous_grid()


    @gluon.jit(do_not_specialize=["num_rows", "num_src_rows"])
    def _nvfp4_wgmma_pipe_list_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, tile_list_ptr,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUPED: gl.constexpr,
        HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
        ERR_FLAG: gl.constexpr, num_warps: gl.constexpr, STAGES: gl.constexpr = 4, W_IL: gl.constexpr = 1,
        KINDS: gl.constexpr = 5, OVERLAP: gl.constexpr = 0,
    ):
        """The pipelined GEMM over a device-built tile list (:func:`_pipe_tile_list_kernel`): one persistent launch
        for the list's tiles of 128, 96 (64 + 32) or 64 token rows (kinds 0, 1, 2; KINDS is the bit set of those it
        compiles: 5 for list A, 2 for list B), each computed exactly as the band kernel of that height computes it
        (the same wgmmas in the same order). List A: one ring sized for the 128-row tile, whose 64-row tiles use the
        first 64 rows of each x slot; list B: the 96-row band kernel's head and tail rings. ``offsets_ptr`` and
        ``num_rows`` are not read (the list holds the schedule).

        Programs take items dynamically (a relaxed atomic on the list's counter ``list[1]``, which the builder
        zeroes), so programs that start late take fewer. OVERLAP 1 (list A): let the next kernel launch at once
        (``griddepcontrol.launch_dependents``); OVERLAP 2 (list B, launched with PDL): start on the SMs that list A's
        programs free, independent of them (disjoint rows, inputs written before list A began), and wait for list A
        only before exiting (``griddepcontrol.wait``), so that whatever follows on the stream sees both lists'
        rows."""
        gl.static_assert(BLOCK_M == 128 and BLOCK_K == 128 and STAGES >= 3)
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        flat_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        if KINDS == 2:  # 96-row tiles only: the 96-row band kernel's rings (head and tail in two allocations)
            x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, BLOCK_K], x_smem_layout)
            xt_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 32, BLOCK_K], x_smem_layout)
        else:  # one 128-row x slot per stage; the 96-row tile's head and tail are row slices of it (one more CTA
            # barrier per K step: Triton orders accesses to slices of one allocation)
            x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], x_smem_layout)
            xt_ring = x_ring
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], flat_layout)
        s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], flat_layout)
        HEAD96: gl.constexpr = 0 if KINDS == 2 else 64  # rows of the 96-row tile's head / tail in their slots (0: all)
        TAIL96: gl.constexpr = 0 if KINDS == 2 else 32
        x_bf16 = x_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        if OVERLAP == 1:
            gl_launch_dependents()
        total_work = gl.load(tile_list_ptr) * n_tiles

        work = gl.atomic_add(tile_list_ptr + 1, 1, sem="relaxed")
        bad_rows = 0  # row_index values outside [0, num_src_rows) (flagged once)
        while work < total_work:
            item = tile_list_ptr + 4 + 4 * (work // n_tiles)
            n_start = (work % n_tiles) * BLOCK_N
            expert = gl.load(item)
            row_start = gl.load(item + 1)
            row_end = gl.load(item + 2)
            kind = gl.load(item + 3)
            # kinds outside KINDS compile to nothing: ptxas keeps the 128- and 64-row paths (KINDS 5) and the 96-row
            # path (KINDS 2) free of spills, but 128 + 96 in one kernel spill in the K loop, and all three serialise
            # every wgmma (C7512, NOTES_gemm.md v24)
            if (KINDS & 1) != 0:
                if kind == 0:
                    bad_rows += _pipe_tile(
                        x_bf16, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, x_ring, x_ring,
                        w_ring, s_ring, row_start, row_end, expert, n_start, N, K, num_experts, num_src_rows,
                        swiglu_limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                        stride_om, 128, 0, BLOCK_N, BLOCK_K, HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT, ERR_FLAG,
                        num_warps, STAGES, 1, W_IL)
            if (KINDS & 2) != 0:
                if kind == 1:
                    bad_rows += _pipe_tile(
                        x_bf16, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, x_ring, xt_ring,
                        w_ring, s_ring, row_start, row_end, expert, n_start, N, K, num_experts, num_src_rows,
                        swiglu_limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                        stride_om, 64, 32, BLOCK_N, BLOCK_K, HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT, ERR_FLAG,
                        num_warps, STAGES, 1, W_IL, 0, HEAD96, HEAD96, TAIL96)
            if (KINDS & 4) != 0:
                if kind == 2:
                    bad_rows += _pipe_tile(
                        x_bf16, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, x_ring, x_ring,
                        w_ring, s_ring, row_start, row_end, expert, n_start, N, K, num_experts, num_src_rows,
                        swiglu_limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                        stride_om, 64, 0, BLOCK_N, BLOCK_K, HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT, ERR_FLAG,
                        num_warps, STAGES, 1, W_IL, 0, 64)
            work = gl.atomic_add(tile_list_ptr + 1, 1, sem="relaxed")
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)
        if OVERLAP == 2:
            gl_wait_for_previous_grid()


@triton.jit
def _pipe_tile_list_kernel(offsets_ptr, list_a_ptr, list_b_ptr, num_rows, num_experts, row_lo, own_pad, capacity,
                           HI_64: tl.constexpr, HI_96: tl.constexpr, HI_128: tl.constexpr, HI_96X2: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    """The two tile lists of :func:`_nvfp4_wgmma_pipe_list_kernel`, from ``expert_offsets`` on the device (one
    program). A list: ``list[0]`` = its number of items, ``list[1]`` = 0 (the list kernel's work counter), item
    i = ``list[4 + 4 i: 8 + 4 i]`` = (expert, first row, the expert's row end, kind).

    Experts with ``row_lo < r`` rows: r <= HI_64 one 64-row tile (kind 2), <= HI_96 one 96-row tile (kind 1),
    <= HI_128 one 128-row tile (kind 0), <= HI_96X2 two 96-row tiles, beyond that 128-row tiles. List A: the kind-0
    tiles, then the kind-2 tiles (each in expert order: the longest first, so the persistent walk balances), then
    with ``own_pad`` the padding rows ``[offsets[E-1], T)`` as expert E in 128-row zero tiles; list B: the kind-1
    tiles. At most ``capacity`` items per list (the host bound; only offsets that decrease, against the contract,
    could need more)."""
    lane, starts, ends, counts = expert_row_ranges(offsets_ptr, num_rows, num_experts, BLOCK_E)
    band = (lane < num_experts) & (counts > row_lo)
    n64 = tl.where(band & (counts <= HI_64), 1, 0)
    n96 = tl.where(band & (counts > HI_64) & (counts <= HI_96), 1,
                   tl.where(band & (counts > HI_128) & (counts <= HI_96X2), 2, 0))
    n128 = tl.where(band & (counts > HI_96) & (counts <= HI_128), 1,
                    tl.where(band & (counts > HI_96X2), (counts + 127) // 128, 0))
    npad = tl.where((lane == num_experts) & (own_pad != 0), (counts + 127) // 128, 0)
    tot128 = tl.sum(n128, axis=0)
    tot64 = tl.sum(n64, axis=0)
    first128 = tl.cumsum(n128, axis=0) - n128
    first64 = tot128 + tl.cumsum(n64, axis=0) - n64
    first_pad = tot128 + tot64
    first96 = tl.cumsum(n96, axis=0) - n96
    tl.store(list_a_ptr, tl.minimum(first_pad + tl.sum(npad, axis=0), capacity))
    tl.store(list_b_ptr, tl.minimum(tl.sum(n96, axis=0), capacity))
    tl.store(list_a_ptr + 1, 0)  # the list kernels' work counters
    tl.store(list_b_ptr + 1, 0)
    most = tl.max(n128 + n96 + n64 + npad, axis=0)
    j = 0
    while j < most:  # tile j of every lane at once (a while loop: the interpreter's range() takes no device value)
        for part in tl.static_range(4):  # 128-row tiles, 64-row, padding (128-row zero tiles): list A; 96-row: B
            if part == 0:
                n, first, height, code, list_ptr = n128, first128, 128, 0, list_a_ptr
            elif part == 1:
                n, first, height, code, list_ptr = n64, first64, 64, 2, list_a_ptr
            elif part == 2:  # the padding lane (lane E: expert E, zeros)
                n, first, height, code, list_ptr = npad, first_pad + 0 * lane, 128, 0, list_a_ptr
            else:
                n, first, height, code, list_ptr = n96, first96, 96, 1, list_b_ptr
            idx = first + j
            ok = (j < n) & (idx < capacity)
            item = list_ptr + 4 + 4 * idx
            tl.store(item, lane, mask=ok)
            tl.store(item + 1, starts + height * j, mask=ok)
            tl.store(item + 2, ends, mask=ok)
            tl.store(item + 3, tl.full([BLOCK_E], code, tl.int32), mask=ok)
        j += 1


def split_tile_rows(tile_m: int) -> tuple[int, int]:
    """A config's BLOCK_M (token rows per tile) -> (head, tail): the kernel's BLOCK_M (the largest power of two
    <= tile_m) and BLOCK_M_TAIL (the rest: 0 or a smaller power of two, >= 16), e.g. 96 -> (64, 32)."""
    if type(tile_m) is not int or tile_m < 16:
        raise ValueError(f"config: BLOCK_M must be an int >= 16, got {tile_m!r}")
    head = 1 << (tile_m.bit_length() - 1)
    tail = tile_m - head
    if tail and (tail & (tail - 1) or tail < 16):
        raise ValueError(f"config: BLOCK_M={tile_m} must be a power of two or the sum of two (each >= 16), e.g. 96")
    return head, tail


def compile_for_sm90(config=PIPE_CONFIG, *, row_index=True, bias=False, swiglu=False, swiglu_limit=True,
                     wait_depth=None, after_band=False):
    """Compile the kernel for sm_90 without a GPU (tests, offline SASS); ``config`` as the launcher's;
    ``after_band``: its AFTER_BAND build."""
    scalars = ["num_rows", "N", "K", "num_experts", "num_programs", "row_lo", "own_pad", "stride_xm", "stride_we",
               "stride_wn", "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om", "row_hi"]
    head, tail = split_tile_rows(config[0])
    extra = dict(STAGES=config[4], WAIT_DEPTH=wait_depth or PIPE_WAIT_DEPTH, **({"AFTER_BAND": True} if after_band
                                                                                 else {}))
    if tail:  # the default build keeps its constants (and its cache key) as before the tail existed
        extra["BLOCK_M_TAIL"] = tail
    return compile_sm90(_nvfp4_wgmma_pipe_kernel, scalars, (head,) + tuple(config[1:3]), config[3], grouped=True,
                        row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                        extra_constants=extra)


def compile_list_for_sm90(kinds: int, *, row_index=True, bias=False, swiglu=False, swiglu_limit=True,
                          weight_interleave=1, overlap=0):
    """Compile the tile-list kernel (``launch_nvfp4_wgmma_pipe(..., tile_list=True)``) for sm_90 without a GPU;
    ``kinds``: its KINDS (5: list A's 128- and 64-row tiles, 2: list B's 96-row tiles); ``overlap``: its OVERLAP."""
    scalars = ["num_rows", "N", "K", "num_experts", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn",
               "stride_ge", "stride_gn", "stride_om"]
    extra = dict(STAGES=PIPE_CONFIG[4], **({"W_IL": weight_interleave} if weight_interleave > 1 else {}),
                 KINDS=kinds, **({"OVERLAP": overlap} if overlap else {}))
    return compile_sm90(_nvfp4_wgmma_pipe_list_kernel, scalars, tuple(PIPE_CONFIG[:3]), PIPE_CONFIG[3],
                        grouped=True, row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                        extra_signature=dict(tile_list_ptr="*i32"), extra_constants=extra)


def tile_list_capacity(num_rows: int, num_experts: int, row_lo: int, own_pad: bool) -> int:
    """Host bound on the items of the tile list (any routing of ``num_rows`` rows with non-decreasing offsets):
    at most ``min(E, T // (row_lo + 1))`` experts take tiles, each at most two besides ``r // 128`` (a 128-row
    expert's ``cdiv(r, 128) < r / 128 + 1``), plus the padding rows' ``cdiv(T, 128)`` zero tiles."""
    experts = min(num_experts, num_rows // (row_lo + 1))
    return 2 * experts + num_rows // 128 + 1 + (triton.cdiv(num_rows, 128) if own_pad else 0)


def tile_list_reference(offsets, num_rows: int, row_lo: int = 0, own_pad: bool = True) -> tuple[list, list]:
    """The two tile lists in Python (tests): ([(expert, first row, the expert's row end, kind)] of list A, of list B),
    in the kernel's order."""
    e64, e96, e128, e192 = PIPE_LIST_EDGES
    ends = [min(max(int(v), 0), num_rows) for v in offsets]
    starts = [0] + ends[:-1]
    kinds = {0: [], 1: [], 2: []}
    for e, (s, end) in enumerate(zip(starts, ends)):
        r = max(end - s, 0)
        if r <= row_lo:
            continue
        if r <= e64:
            tiles = [(2, 0)]
        elif r <= e96:
            tiles = [(1, 0)]
        elif r <= e128:
            tiles = [(0, 0)]
        elif r <= e192:
            tiles = [(1, 0), (1, 96)]
        else:
            tiles = [(0, j) for j in range(0, r, 128)]
        for kind, first in tiles:
            kinds[kind].append((e, s + first, end, kind))
    last = ends[-1] if ends else 0
    pad = [(len(ends), j, num_rows, 0) for j in range(last, num_rows, 128)] if own_pad else []
    return kinds[0] + kinds[2] + pad, kinds[1]


def launch_tile_lists(expert_offsets: torch.Tensor, num_rows: int, num_experts: int, row_lo: int = 0,
                      own_pad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The device-built tile lists A and B (int32, ``4 + 4 x`` :func:`tile_list_capacity` each): one launch of
    :func:`_pipe_tile_list_kernel`, no host read of the offsets (the interpreter runs it on CPU tensors)."""
    capacity = tile_list_capacity(num_rows, num_experts, row_lo, own_pad)
    lists = torch.empty(2, 4 + 4 * capacity, dtype=torch.int32, device=expert_offsets.device)
    _pipe_tile_list_kernel[(1,)](expert_offsets, lists[0], lists[1], num_rows, num_experts, row_lo, int(own_pad),
                                 capacity, *PIPE_LIST_EDGES, BLOCK_E=max(32, triton.next_power_of_2(num_experts + 1)),
                                 num_warps=4)
    return lists[0], lists[1]


def pipe_supported(k: int, config=PIPE_CONFIG) -> bool:
    """Host-shape rule: K a multiple of 256 (the 128-K step, and scale rows of K / 16 bytes that the compiler can
    prove 16-byte aligned, which the 8-byte scale copies need: K = 384 fails to lower). Every V4 shape qualifies."""
    return k % 256 == 0 and config[2] == MMA_K_GROUP


def launch_nvfp4_wgmma_pipe(
    x: torch.Tensor,
    data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    expert_offsets: torch.Tensor,
    row_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
    interpreter: bool = False,
    config=None,
    error_word: torch.Tensor | None = None,
    row_lo: int = 0,
    row_hi: int | None = None,
    own_pad: bool = True,
    x_in_mma_order: bool = False,
    wait_depth: int | None = None,
    weight_interleave: int = 1,
    tile_list: bool = False,
    after_band: bool = False,
) -> torch.Tensor:
    """Launch the pipelined wgmma grouped GEMM (contract of
    :func:`megamoe.kernels.gemm.nvfp4_wgmma.launch_nvfp4_wgmma`, grouped only).

    ``x``: (S, K) bf16 activations in memory K order (copied once into the MMA K order, a (S, K) temporary),
    or already in it with ``x_in_mma_order=True``. ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES[,
    programs per SM (default 1)[, register cap per thread (ptxas maxnreg; default none)]]); BLOCK_M (token rows per
    tile) a power of two or the sum of two (:func:`split_tile_rows`: 96 = 64 + 32 runs a 64-row and a 32-row wgmma
    on the same decoded weights).
    ``row_lo`` / ``row_hi``: compute only the experts with ``row_lo < rows <= row_hi`` (a band of
    :func:`megamoe.ops.gemm.plan_row_bands`; others' rows are left untouched); ``own_pad``: write zeros to the
    padding rows ``[offsets[E-1], T)``. ``wait_depth``: 1-3 sub-steps left in flight (default
    :data:`PIPE_WAIT_DEPTH`); the same bits for every value. ``weight_interleave`` (1 or 4): ``data`` and
    ``block_scale`` hold groups of that many weight rows interleaved per 128-K step
    (:func:`megamoe.format.layouts.interleave_weight_rows`, ``NVFP4Tensor.row_interleave``; NOTES_gemm.md v21).
    ``tile_list``: every expert with more than ``row_lo`` rows in two persistent launches over device-built lists
    (:func:`launch_tile_lists`): list A's 128- and 64-row tiles, then list B's 96-row tiles, started on the SMs list
    A frees when :data:`PIPE_LIST_OVERLAP` is on (:data:`PIPE_LIST_EDGES`; the same bits as the band launches of those
    heights); ``config`` (None: :data:`PIPE_CONFIG`'s ring), ``row_hi`` (None) and ``wait_depth`` (None or 1) are
    fixed then.
    ``after_band`` (band launches only, ``x_in_mma_order``): a later band of one banded GEMM whose inputs were final
    before the previous band started: launched with PDL where supported, beside the previous band (the same bits).
    """
    if interpreter:
        raise ValueError("interpreter: the Gluon kernels run on sm_90 GPUs only")
    if expert_offsets is None:
        raise ValueError("expert_offsets: this kernel is grouped only")
    check_weight_interleave(weight_interleave, data)
    if wait_depth is not None and (type(wait_depth) is not int or wait_depth not in (1, 2, 3)):
        raise ValueError(f"wait_depth: expected None or 1, 2 or 3, got {wait_depth!r}")
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0]
    if num_rows == 0 or n == 0:
        return out
    if tile_list and (config is not None or row_hi is not None or wait_depth not in (None, 1)):
        raise ValueError("tile_list: the tile-list launch takes no config, row_hi or wait_depth other than 1 "
                         f"(got config={config!r}, row_hi={row_hi!r}, wait_depth={wait_depth!r})")
    if after_band and (tile_list or not x_in_mma_order):
        raise ValueError("after_band: only a band launch of x already in the MMA K order (no copy kernel between "
                         "the bands)")
    config = config or PIPE_CONFIG
    block_m, block_n, block_k, num_warps, stages = config[:5]
    per_sm = config[5] if len(config) > 5 else 1
    maxnreg = config[6] if len(config) > 6 else None  # registers per thread, for per_sm programs of num_warps
    head_m, tail_m = split_tile_rows(block_m)
    if tail_m and (wait_depth or PIPE_WAIT_DEPTH) != 1:
        raise ValueError(f"wait_depth: a BLOCK_M={block_m} tile (head + tail) runs with wait_depth 1 only")
    if not pipe_supported(k, config):
        raise ValueError(f"data: K={k} must be a multiple of 256 (and BLOCK_K={block_k} = {MMA_K_GROUP}) for this "
                         "kernel")
    row_hi = ROW_HI_UNBOUNDED if row_hi is None else row_hi
    m_tiles_bound = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows // (row_lo + 1)) + 1
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    programs = min(work_bound, _num_sms(x.device.index or 0) * per_sm)
    if not x_in_mma_order:
        x = launch_to_mma_k_order(x)
    head, strides, flags = kernel_arguments(x, data, block_scale, global_scale, out, expert_offsets=expert_offsets,
                                            row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                                            error_word=error_word)
    if tile_list:  # list A: the 128- and 64-row tiles (and the padding rows), then list B: the 96-row tiles
        items = tile_list_capacity(num_rows, num_experts, row_lo, own_pad)
        programs = min(items * triton.cdiv(n, block_n), _num_sms(x.device.index or 0))
        overlap = PIPE_LIST_OVERLAP and pdl_supported(x)
        for tiles, kinds, role in zip(launch_tile_lists(expert_offsets, num_rows, num_experts, row_lo, own_pad),
                                      (5, 2), (1, 2)):
            _nvfp4_wgmma_pipe_list_kernel[(programs,)](
                *head, tiles, *strides, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=num_warps, STAGES=stages, KINDS=kinds, **flags,
                **({"W_IL": weight_interleave} if weight_interleave > 1 else {}),
                **({"OVERLAP": role, "launch_pdl": role == 2} if overlap else {}))
        return out
    overlap = after_band and pdl_supported(x)
    _nvfp4_wgmma_pipe_kernel[(programs,)](
        *head, programs, row_lo, int(own_pad), *strides, row_hi, BLOCK_M=head_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts + 1)), num_warps=num_warps, STAGES=stages,
        WAIT_DEPTH=wait_depth or PIPE_WAIT_DEPTH, **flags, **({"BLOCK_M_TAIL": tail_m} if tail_m else {}),
        **({"maxnreg": maxnreg} if maxnreg else {}), **({"W_IL": weight_interleave} if weight_interleave > 1 else {}),
        **({"AFTER_BAND": True, "launch_pdl": True} if overlap else {}),
    )
    return out
