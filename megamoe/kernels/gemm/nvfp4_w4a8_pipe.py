"""W4A8 grouped GEMM on Hopper's FP8 tensor cores, pipelined (Gluon, async ``wgmma`` chain): w4a8 v2.

One kernel, one launcher (:func:`launch_nvfp4_w4a8_pipe`). Issue 13; design, prediction and outcome in
``benchmarks/NOTES_gemm.md`` ("w4a8 v2").

The structure of the bf16 pipelined kernel (``nvfp4_wgmma_pipe.py``) with FP8 operands:

* **One cp.async ring** for everything a 128-K step reads: the FP8 activation tile (rows gathered by
  ``row_index``, already in the FP8 MMA K order of :func:`megamoe.format.mma_order.fp8_mma_k_permutation`, written
  that way by the quantizer), the packed FP4 words and the E4M3 scale bytes of the weight tile.
* **Swap-AB**, a program computes ``out^T`` tiles ``W (BLOCK_N = 128 weight rows) @ x^T (128 x BLOCK_M tokens)``;
  each of the two warpgroups owns one m64 tile of weight rows. Each 128-K step is four 32-K sub-steps; sub-step
  ``i`` decodes word ``i`` of every lane's four (memory K ``32 q + 8 i ..``) straight into the FP8 A fragment of one
  ``m64 x BLOCK_M x k32`` wgmma (``k_width`` 4: the lane's registers for K ``4 q + c`` and ``16 + 4 q + c`` hold the
  word's elements 0-3 and 4-7) and issues it without waiting; only the sub-step before is waited for.
* **The decode by table:** per (weight row, block) and step, :func:`_block_luts` computes the block's eight E4M3
  operands (one per E2M1 magnitude); each element is then a ``prmt`` lookup plus its sign (:func:`_decode_fp8_word`).

Numerics are w4a8 v1's (``megamoe/reference/w4a8.py`` is the oracle): per weight row and 128-K step,
``S = pow2ceil(max_j |s_j|)`` over the step's eight block scales; operand ``e4m3_rne(e2m1 * s_j / S)`` (exact in f16,
one ``cvt.rn.satfinite.e4m3x2.f16x2``, in the table). Each step's four wgmmas sum into a fresh ``partial`` (the first
with ``use_acc=False``), promoted into the fp32 accumulator as ``acc += partial * S[n]``. The promotion of step ``t`` is
done after step ``t + 1``'s first sub-step is decoded, so the tensor core's tail of step ``t`` overlaps that decode.
Epilogue: ``acc * s_x[m]`` (per-token scale, gathered by ``row_index``), then the family's epilogue (global scale,
bias / SwiGLU + clamp, one bf16 rounding).

Registers: acc and partial are 64 fp32 each per thread (BLOCK_M 128); the bf16 kernel's 256-row tile would need
twice that. The A operands cannot be listed in ``warpgroup_mma_wait``'s deps (Triton 3.6 aborts on 8-bit deps) and
ptxas does not keep registers that an async wgmma still reads: the offline test ``test_sm90_w4a8_pipe_k_loop`` checks
every launched build for such a write (NOTES_gemm.md, "w4a8 v2"). Requirements: sm_90, K % 256 == 0
(:func:`w4a8_pipe_supported`), row-major or 4-row interleaved weights (``W_IL``), grouped (``nvfp4_linear`` runs a
dense GEMM as one expert of M rows).
"""
from __future__ import annotations

import os

import torch
import triton

from .nvfp4_gemm import _num_sms
from .nvfp4_gluon_jit import GLUON_AVAILABLE, check_weight_interleave, compile_sm90, kernel_arguments
from .nvfp4_mma_decode import ROW_HI_UNBOUNDED
from .nvfp4_wgmma_pipe import split_tile_rows

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

    from .nvfp4_gluon_jit import (grouped_tile_table, interleaved_row_offsets, locate_tile, scale_layout,
                                  tile_row_pointers, weight_layout, word_bytes)
    from .nvfp4_wgmma_pipe import _store_tile, _store_zeros

# (BLOCK_M token rows = the wgmma N, BLOCK_N weight rows, BLOCK_K, num_warps, STAGES). Shared memory per stage:
# x BLOCK_M x 128 bytes + weights BLOCK_N x 64 + scales BLOCK_N x 8 (25 KB at the default, 125 KB for 5 stages).
# MEGAMOE_W4A8_PIPE_CONFIG="BLOCK_M,BLOCK_N,BLOCK_K,num_warps,STAGES" (read at import) overrides it for sweeps.
W4A8_PIPE_CONFIG = tuple(int(v) for v in os.environ.get("MEGAMOE_W4A8_PIPE_CONFIG", "128,128,128,8,5").split(","))
# The grouped w4a8 GEMMs on sm_90 run this kernel where it applies (:func:`w4a8_pipe_supported`), else w4a8 v1
# (``nvfp4_w4a8.py``): env MEGAMOE_W4A8_PIPE (read at import), "1" (default) on, "0" off (A/B runs).
W4A8_PIPE_ROUTE = os.environ.get("MEGAMOE_W4A8_PIPE", "1").strip() not in ("", "0")
# Row bands (rows per expert, upper edge -> config), each its own launch, instead of 128-row tiles that would be up to
# half padding (V4-Pro at 4096 tokens averages 64 rows per expert, V4-Flash 96): experts of <= 64 rows run 64-row tiles
# (NOTES_gemm.md "A 64-row band"), those of 65-96 rows 96-row (64 + 32) tiles (H100, results/gpu_check_v28/b: the op
# 5-8% faster at 4096 tokens than with the 64 band alone), 97-128 rows one 128-row tile and 129-192 rows two 96-row
# tiles (a 128-row tile would leave the second one up to 127/128 padding: the layer profile gpu_check_v28 f); the rest
# run W4A8_PIPE_CONFIG. Env MEGAMOE_W4A8_BANDS (read at import): a comma list of "edge" (tiles of edge rows) or
# "edge:rows" items, default "64,96,128,192:96"; "" / "0": no bands.


def band_configs(spec: str) -> dict:
    """{upper edge (rows per expert): config} of a MEGAMOE_W4A8_BANDS string, in edge order."""
    configs = {}
    for item in spec.split(","):
        item = item.strip()
        if item in ("", "0"):
            continue
        edge, _, rows = item.partition(":")
        configs[int(edge)] = (int(rows or edge),) + W4A8_PIPE_CONFIG[1:]
    return dict(sorted(configs.items()))


W4A8_BAND_CONFIGS = band_configs(os.environ.get("MEGAMOE_W4A8_BANDS", "64,96,128,192:96"))
SUB_K = 32  # K per FP8 wgmma: one packed word per lane
_SUB_K = gl.constexpr(SUB_K) if GLUON_AVAILABLE else SUB_K


def dense_config(num_rows: int) -> tuple:
    """The config of a dense GEMM (one expert of ``num_rows`` rows, a host value): the smallest band tile that holds
    it (:data:`W4A8_BAND_CONFIGS`), else :data:`W4A8_PIPE_CONFIG` (128-row tiles)."""
    for edge, config in sorted(W4A8_BAND_CONFIGS.items()):
        if num_rows <= edge:
            return config
    return W4A8_PIPE_CONFIG


def band_plan(num_rows: int, num_experts: int) -> list:
    """The launches of a grouped GEMM of ``num_rows`` rows over ``num_experts`` experts (host values only), in order:
    ``[(config, row_lo, row_hi or None, own_pad)]``. One expert: a single launch in the smallest band tile that holds
    every row (:func:`dense_config`). Otherwise a launch per band of :data:`W4A8_BAND_CONFIGS` that an expert can fall
    in (its lower edge below ``num_rows``), then the rest in :data:`W4A8_PIPE_CONFIG` tiles with the padding rows.
    Every expert's rows fall in exactly one launch's ``(row_lo, row_hi]``, whatever the routing."""
    if num_experts == 1:
        return [(dense_config(num_rows), 0, None, True)]
    plan, lo = [], 0
    for hi, config in W4A8_BAND_CONFIGS.items():
        if num_rows > lo:
            plan.append((config, lo, hi, False))
        lo = hi
    plan.append((W4A8_PIPE_CONFIG, lo, None, True))
    return plan


if GLUON_AVAILABLE:

    @gluon.jit
    def _block_luts(factor):
        """fp32 ``(s_j / S) * 2**14`` per (row, block) -> the block's E4M3 table: (bytes 0-3, bytes 4-7) as int32, byte
        ``v`` = ``e4m3_rne(e2m1(v) * s_j / S)`` for the magnitude codes v = 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6).

        Each pair of magnitudes is the f16 ``e2m1 * 2**-14`` (a constant), one ``mul.rn.f16x2`` by the factor gives
        ``e2m1 * s_j / S`` exactly (at most 6 significant bits, >= 2**-19: f16 keeps it) and one
        ``cvt.rn.satfinite.e4m3x2.f16x2`` rounds it once: w4a8 v1's operand, computed once per block instead of once
        per element."""
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 s, a, k;
            .reg .b16 e0, e1, e2, e3;
            cvt.rn.f16x2.f32 s, $2, $2;
            mov.b32 k, 0x02000000;
            mul.rn.f16x2 a, s, k;
            cvt.rn.satfinite.e4m3x2.f16x2 e0, a;
            mov.b32 k, 0x06000400;
            mul.rn.f16x2 a, s, k;
            cvt.rn.satfinite.e4m3x2.f16x2 e1, a;
            mov.b32 k, 0x0A000800;
            mul.rn.f16x2 a, s, k;
            cvt.rn.satfinite.e4m3x2.f16x2 e2, a;
            mov.b32 k, 0x0E000C00;
            mul.rn.f16x2 a, s, k;
            cvt.rn.satfinite.e4m3x2.f16x2 e3, a;
            mov.b32 $0, {e0, e1};
            mov.b32 $1, {e2, e3};
            }
            """,
            constraints="=r,=r,r",
            args=[factor],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _decode_fp8_word(packed, lut_lo, lut_hi):
        """Packed bytes (uint8, 4 per call: one word, elements 0-7 = its nibbles in memory order) and the word's block
        table (:func:`_block_luts`; the first of each four is read) -> (elements 0-3, elements 4-7) as E4M3.

        Per four elements: ``prmt`` looks the magnitudes (nibble & 7) up in the table; a second ``prmt`` of 0x80 bytes
        with the raw nibbles as selectors gives 0xFF where the sign bit (nibble bit 3: ``prmt``'s sign-replicate flag)
        is set, else 0x80, whose bit 6 shifted to bit 7 is the E4M3 sign (E4M3 rounding is symmetric)."""
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 sel, w, m, t, k;
            mov.b32 k, 0x80808080;
            and.b32 sel, $2, 0x7777;
            prmt.b32 m, $3, $7, sel;
            prmt.b32 t, k, k, $2;
            shl.b32 t, t, 1;
            lop3.b32 $0, m, t, 0x80808080, 0xF8;
            shr.u32 w, $2, 16;
            and.b32 sel, w, 0x7777;
            prmt.b32 m, $3, $7, sel;
            prmt.b32 t, k, k, w;
            shl.b32 t, t, 1;
            lop3.b32 $1, m, t, 0x80808080, 0xF8;
            }
            """,
            constraints="=r,=r,r,r,r,r,r,r,r,r,r",
            args=[packed, lut_lo, lut_hi],
            dtype=(gl.float8e4nv, gl.float8e4nv),
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def _step_scales(scale_bytes, BLOCK_N: gl.constexpr):
        """A 128-K step's (BLOCK_N, 8) scale bytes -> (per-block decode factors ``(s_j / S) * 2**14`` fp32, S per row
        fp32): ``S = pow2ceil(max_j |s_j|)``, 1 for a row of zero scales, NaN when a scale is NaN (0x7F / 0xFF)."""
        magnitude = scale_bytes.to(gl.int32) & 0x7F
        top = gl.max(magnitude, axis=1)  # the largest |s_j| (the byte order of positive E4M3 is the value order)
        top_f = top.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32)
        bits = top_f.to(gl.int32, bitcast=True)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        exponent = gl.where(top == 0, 127, exponent)
        exponent = gl.where(top == 0x7F, 128, exponent)  # NaN: any S; it is replaced by NaN below
        big_s = (exponent << 23).to(gl.float32, bitcast=True)
        big_s = gl.where(top == 0x7F, float("nan"), big_s)
        inv = ((254 - exponent + 14) << 23).to(gl.float32, bitcast=True)  # 2**14 / S, exact
        factor = scale_bytes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * inv[:, None]
        return factor, big_s

    @gluon.jit
    def _decode_sub_fp8(words, lut_lo, lut_hi, i: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """Sub-step ``i`` of a 128-K step: word ``i`` of each lane's four and its block's table -> the FP8 A operand
        (BLOCK_N, 32) in FP8 MMA K order ``c + 4q + 16g`` (memory ``32q + 8i + 4g + c``)."""
        quads = words.reshape([BLOCK_N, 4, 2, 2])  # n, q, i >> 1, i & 1
        even, odd = gl.split(quads)
        half = odd if i % 2 == 1 else even
        low, high = gl.split(half)
        word = high if i // 2 == 1 else low  # (BLOCK_N, 4): one word per quad lane
        packed = word_bytes(word)  # (BLOCK_N, 16): n, q, byte
        lo_q = lut_lo.reshape([BLOCK_N, 4, 2])  # n, q, block of the lane's two
        hi_q = lut_hi.reshape([BLOCK_N, 4, 2])
        lo0, lo1 = gl.split(lo_q)
        hi0, hi1 = gl.split(hi_q)
        lo = lo1 if i // 2 == 1 else lo0
        hi = hi1 if i // 2 == 1 else hi0
        lo = gl.join(lo, lo)
        lo = gl.convert_layout(gl.join(lo, lo).reshape([BLOCK_N, 16]), packed.type.layout)
        hi = gl.join(hi, hi)
        hi = gl.convert_layout(gl.join(hi, hi).reshape([BLOCK_N, 16]), packed.type.layout)
        first, second = _decode_fp8_word(packed, lo, hi)  # (BLOCK_N, 16): n, q, c (elements c and 4 + c)
        w = gl.join(first, second).reshape([BLOCK_N, 4, 4, 2])  # n, q, c, g
        w = w.permute([0, 3, 1, 2]).reshape([BLOCK_N, 32])  # n, g, q, c
        return gl.convert_layout(w, a_layout)

    @gluon.jit
    def _fill(x_ring, xt_ring, w_ring, s_ring, slot, xr_ptrs, xr_mask, xt_ptrs, xt_mask, wr_ptrs, sr_ptrs, step,
              BLOCK_K: gl.constexpr, BLOCK_M_TAIL: gl.constexpr, W_IL: gl.constexpr):
        """cp.async of K step ``step``'s FP8 x rows (masked rows zero-filled; the tail rows into ``xt_ring`` when
        BLOCK_M_TAIL > 0), weight words and scale bytes."""
        async_copy.async_copy_global_to_shared(x_ring.index(slot), xr_ptrs + step * BLOCK_K, mask=xr_mask)
        if BLOCK_M_TAIL > 0:
            async_copy.async_copy_global_to_shared(xt_ring.index(slot), xt_ptrs + step * BLOCK_K, mask=xt_mask)
        async_copy.async_copy_global_to_shared(w_ring.index(slot), wr_ptrs + step * (W_IL * BLOCK_K // 8))
        async_copy.async_copy_global_to_shared(s_ring.index(slot), sr_ptrs + step * (W_IL * BLOCK_K // 16))

    @gluon.jit
    def _step_mmas(partial, partial_t, words, lut_lo, lut_hi, xs, xts, a_layout: gl.constexpr, at_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, FIRST_A, BLOCK_M_TAIL: gl.constexpr):
        """Sub-steps of a step (sub-step 0's A, ``FIRST_A``, was decoded by the caller): async wgmmas into ``partial``
        (and, with BLOCK_M_TAIL > 0, the same A into ``partial_t`` for the tail rows; otherwise ``partial_t`` is
        passed through), the first from zero; at most one sub-step left in flight. (The A operands cannot be kept
        alive through the wait's deps: module docstring.)"""
        partial = warpgroup_mma(FIRST_A, xs.slice(0, _SUB_K, dim=1).permute([1, 0]), partial, use_acc=False,
                                is_async=True)
        if BLOCK_M_TAIL > 0:
            partial_t = warpgroup_mma(gl.convert_layout(FIRST_A, at_layout),
                                      xts.slice(0, _SUB_K, dim=1).permute([1, 0]), partial_t, use_acc=False,
                                      is_async=True)
            partial, partial_t = warpgroup_mma_wait(2, deps=[partial, partial_t])
        else:
            partial = warpgroup_mma_wait(1, deps=[partial])
        for i in gl.static_range(1, BLOCK_K // _SUB_K):
            a = _decode_sub_fp8(words, lut_lo, lut_hi, i, a_layout, BLOCK_N)
            partial = warpgroup_mma(a, xs.slice(_SUB_K * i, _SUB_K, dim=1).permute([1, 0]), partial, is_async=True)
            if BLOCK_M_TAIL > 0:
                # the same A registers (a conversion between equal linear layouts: no instructions)
                partial_t = warpgroup_mma(gl.convert_layout(a, at_layout),
                                          xts.slice(_SUB_K * i, _SUB_K, dim=1).permute([1, 0]), partial_t,
                                          is_async=True)
                partial, partial_t = warpgroup_mma_wait(2, deps=[partial, partial_t])
            else:
                partial = warpgroup_mma_wait(1, deps=[partial])
        return partial, partial_t

    @gluon.jit
    def _token_scales(acc, row_start, row_end, row_index_ptr, x_scale_ptr, num_src_rows, ROWS: gl.constexpr,
                      HAS_ROW_INDEX: gl.constexpr):
        """acc (weight rows x ROWS token rows from ``row_start``) times each token's activation scale (gathered by
        ``row_index``; 0 for rows past the end or out of range) and 2**-8 (the shared epilogue multiplies by 256, the
        bf16 decode's factor)."""
        t_rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc.type.layout))
        t_ok = t_rows < row_end
        if HAS_ROW_INDEX:
            t_src = gl.load(row_index_ptr + t_rows, mask=t_ok, other=0)
            t_ok = t_ok & (t_src >= 0) & (t_src < num_src_rows)
        else:
            t_src = t_rows
        x_scale = gl.load(x_scale_ptr + t_src, mask=t_ok, other=0.0)
        return acc * (x_scale * 0.00390625)[None, :]

    @gluon.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows", "row_lo", "row_hi", "own_pad"])
    def _nvfp4_w4a8_pipe_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, x_scale_ptr, row_lo, row_hi, own_pad,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 5, BLOCK_M_TAIL: gl.constexpr = 0, W_IL: gl.constexpr = 1,
    ):
        """Grouped W4A8 GEMM: FP8 x (S, K) in the FP8 MMA K order, per-token scales ``x_scale_ptr`` (S,) fp32,
        NVFP4 weights; one ring, an async FP8 wgmma chain and a per-step promotion (module docstring). Only the
        experts with ``row_lo < rows <= row_hi`` (a row band); the padding rows with ``own_pad``. A tile holds
        BLOCK_M + BLOCK_M_TAIL token rows: with BLOCK_M_TAIL > 0 the tail has its own x ring part, partial and
        accumulator, fed by the same decoded weights (96 = 64 + 32: shapes must be powers of two). W_IL > 1: the weight
        words and scale bytes hold rows interleaved in groups of W_IL per 128-K step
        (:func:`megamoe.format.layouts.interleave_weight_rows`); only the ring's source addresses change."""
        gl.static_assert(BLOCK_K == 128)
        gl.static_assert(STAGES >= 3)
        gl.static_assert(BLOCK_N == 16 * num_warps)  # one m64 tile of weight rows per warpgroup
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 32])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        MT: gl.constexpr = BLOCK_M_TAIL if BLOCK_M_TAIL > 0 else BLOCK_M
        mma_t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, MT, 32])
        at_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t_layout, k_width=4)
        TILE_M: gl.constexpr = BLOCK_M + BLOCK_M_TAIL
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        flat_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], x_smem_layout)
        if BLOCK_M_TAIL > 0:
            xt_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M_TAIL, BLOCK_K], x_smem_layout)
        else:
            xt_ring = x_ring  # not read
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], flat_layout)
        s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], flat_layout)
        # copy layouts: 16-byte chunks of x (16 FP8) and of weight words (4 int32), one 8-byte chunk of scales
        xr_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_K // 16), BLOCK_K // 16], [num_warps, 1],
                                                   [1, 0])
        wr_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BLOCK_K // 32), BLOCK_K // 32], [num_warps, 1],
                                                   [1, 0])
        sr_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 16], [32, 1], [num_warps, 1], [1, 0])
        xr_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xr_layout))
        wr_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, wr_layout))
        sr_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, sr_layout))
        x_fp8 = x_ptr.to(gl.pointer_type(gl.float8e4nv), bitcast=True)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        k_tiles = K // BLOCK_K
        lane, starts, ends, tiles, tile_ends, total_tiles = grouped_tile_table(
            offsets_ptr, num_rows, num_experts, row_lo, row_hi, own_pad, TILE_M, BLOCK_E, 1, num_warps)
        total_work = total_tiles * n_tiles

        work = gl.program_id(0)
        bad_rows = 0  # row_index values outside [0, num_src_rows) (flagged once)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            row_start, row_end, expert = locate_tile(tile, lane, starts, ends, tiles, tile_ends, TILE_M)
            is_real = expert < num_experts
            expert_c = gl.minimum(expert, num_experts - 1).to(gl.int64)
            w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wr_layout)), N - 1)
            s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sr_layout)), N - 1)
            # one 128-K step = one interleaved chunk: the columns stay, the row offsets and step change (W_IL 1:
            # row * stride)
            w_off = interleaved_row_offsets(w_rows, stride_wn, BLOCK_K // 8, W_IL)
            s_off = interleaved_row_offsets(s_rows, stride_sn, BLOCK_K // 16, W_IL)
            wr_ptrs = w_ptr + expert_c * stride_we + w_off[:, None] + wr_cols[None, :]
            sr_ptrs = scale_ptr + expert_c * stride_se + s_off[:, None] + sr_cols[None, :]
            if HAS_ROW_INDEX:
                xr_ptrs, xr_mask, bad = tile_row_pointers(x_fp8, row_index_ptr, row_start, row_end, is_real,
                                                          num_src_rows, 4 * stride_xm, xr_cols, BLOCK_M, xr_layout,
                                                          ERR_FLAG)
                bad_rows += bad
            else:
                r_rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xr_layout))
                xr_ptrs = x_fp8 + gl.where(r_rows < row_end, r_rows, 0).to(gl.int64)[:, None] * (4 * stride_xm) \
                    + xr_cols[None, :]
                xr_mask = None
            if BLOCK_M_TAIL > 0:
                if HAS_ROW_INDEX:
                    xt_ptrs, xt_mask, bad = tile_row_pointers(x_fp8, row_index_ptr, row_start + BLOCK_M, row_end,
                                                              is_real, num_src_rows, 4 * stride_xm, xr_cols,
                                                              BLOCK_M_TAIL, xr_layout, ERR_FLAG)
                    bad_rows += bad
                else:
                    t_rows = row_start + BLOCK_M + gl.arange(0, BLOCK_M_TAIL, layout=gl.SliceLayout(1, xr_layout))
                    xt_ptrs = x_fp8 + gl.where(t_rows < row_end, t_rows, 0).to(gl.int64)[:, None] * (4 * stride_xm) \
                        + xr_cols[None, :]
                    xt_mask = None
            else:
                xt_ptrs = xr_ptrs  # not read
                xt_mask = xr_mask
            if is_real:
                acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
                if BLOCK_M_TAIL > 0:
                    acc_t = gl.zeros([BLOCK_N, BLOCK_M_TAIL], gl.float32, layout=mma_t_layout)
                else:
                    acc_t = acc  # passed through untouched
                gl.thread_barrier()  # every warpgroup's MMAs of the previous tile have read the ring
                for j in gl.static_range(STAGES - 2):
                    if j < k_tiles:
                        _fill(x_ring, xt_ring, w_ring, s_ring, j, xr_ptrs, xr_mask, xt_ptrs, xt_mask, wr_ptrs, sr_ptrs,
                              j, BLOCK_K, BLOCK_M_TAIL, W_IL)
                    async_copy.commit_group()
                # step 0, peeled (every path from the zeroing to the final wait passes a wgmma: C7515)
                async_copy.wait_group(STAGES - 3)
                words = w_ring.index(0).load(w_layout)
                factor, big_s = _step_scales(s_ring.index(0).load(s_layout), BLOCK_N)
                lut_lo, lut_hi = _block_luts(factor)
                if STAGES - 2 < k_tiles:
                    _fill(x_ring, xt_ring, w_ring, s_ring, (STAGES - 2) % STAGES, xr_ptrs, xr_mask, xt_ptrs, xt_mask,
                          wr_ptrs, sr_ptrs, STAGES - 2, BLOCK_K, BLOCK_M_TAIL, W_IL)
                async_copy.commit_group()
                a_first = _decode_sub_fp8(words, lut_lo, lut_hi, 0, a_layout, BLOCK_N)
                partial, partial_t = _step_mmas(acc, acc_t, words, lut_lo, lut_hi, x_ring.index(0), xt_ring.index(0),
                                                a_layout, at_layout, BLOCK_N, BLOCK_K, a_first, BLOCK_M_TAIL)
                s_prev = gl.convert_layout(big_s, gl.SliceLayout(1, mma_layout))
                s_prev_t = gl.convert_layout(big_s, gl.SliceLayout(1, mma_t_layout))
                for step in range(1, k_tiles):
                    slot = step % STAGES
                    async_copy.wait_group(STAGES - 3)  # this thread's copies of `step` have landed
                    # the compiler's barrier after the wait: everyone's have, and every warpgroup's MMAs of
                    # step - 2 (waited for in step - 1) are complete
                    words = w_ring.index(slot).load(w_layout)
                    factor, big_s = _step_scales(s_ring.index(slot).load(s_layout), BLOCK_N)
                    lut_lo, lut_hi = _block_luts(factor)
                    ahead = step + STAGES - 2  # its slot was read by the MMAs of step - 2
                    if ahead < k_tiles:
                        _fill(x_ring, xt_ring, w_ring, s_ring, ahead % STAGES, xr_ptrs, xr_mask, xt_ptrs, xt_mask,
                              wr_ptrs, sr_ptrs, ahead, BLOCK_K, BLOCK_M_TAIL, W_IL)
                    async_copy.commit_group()
                    a_first = _decode_sub_fp8(words, lut_lo, lut_hi, 0, a_layout, BLOCK_N)
                    # step - 1 complete: promote its partial, then the partial registers start this step
                    if BLOCK_M_TAIL > 0:
                        partial, partial_t = warpgroup_mma_wait(0, deps=[partial, partial_t])
                        acc_t = acc_t + partial_t * s_prev_t[:, None]
                    else:
                        partial = warpgroup_mma_wait(0, deps=[partial])
                    acc = acc + partial * s_prev[:, None]
                    partial, partial_t = _step_mmas(partial, partial_t, words, lut_lo, lut_hi, x_ring.index(slot),
                                                    xt_ring.index(slot), a_layout, at_layout, BLOCK_N, BLOCK_K,
                                                    a_first, BLOCK_M_TAIL)
                    s_prev = gl.convert_layout(big_s, gl.SliceLayout(1, mma_layout))
                    s_prev_t = gl.convert_layout(big_s, gl.SliceLayout(1, mma_t_layout))
                if BLOCK_M_TAIL > 0:
                    partial, partial_t = warpgroup_mma_wait(0, deps=[partial, partial_t])
                    acc_t = acc_t + partial_t * s_prev_t[:, None]
                else:
                    partial = warpgroup_mma_wait(0, deps=[partial])
                acc = acc + partial * s_prev[:, None]
                acc = _token_scales(acc, row_start, row_end, row_index_ptr, x_scale_ptr, num_src_rows, BLOCK_M,
                                    HAS_ROW_INDEX)
                _store_tile(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                            stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS,
                            SWIGLU, HAS_LIMIT, num_warps)
                if BLOCK_M_TAIL > 0:
                    acc_t = _token_scales(acc_t, row_start + BLOCK_M, row_end, row_index_ptr, x_scale_ptr,
                                          num_src_rows, BLOCK_M_TAIL, HAS_ROW_INDEX)
                    _store_tile(acc_t, row_start + BLOCK_M, row_end, is_real, n_start, N, global_scale_ptr, expert_c,
                                stride_ge, stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M_TAIL,
                                BLOCK_N, HAS_BIAS, SWIGLU, HAS_LIMIT, num_warps)
            else:
                _store_zeros(out_ptr, row_start, row_end, n_start, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU,
                             num_warps)
                if BLOCK_M_TAIL > 0:
                    _store_zeros(out_ptr, row_start + BLOCK_M, row_end, n_start, N, stride_om, BLOCK_M_TAIL, BLOCK_N,
                                 SWIGLU, num_warps)
            work += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)


def compile_w4a8_pipe_for_sm90(config=W4A8_PIPE_CONFIG, *, row_index=True, bias=False, swiglu=False,
                               swiglu_limit=True, weight_interleave=1):
    """Compile the kernel for sm_90 without a GPU (tests, offline SASS); ``config`` and ``weight_interleave`` as the
    launcher's."""
    scalars = ["num_rows", "N", "K", "num_experts", "num_programs", "row_lo", "row_hi", "own_pad", "stride_xm",
               "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om"]
    head, tail = split_tile_rows(config[0])
    return compile_sm90(_nvfp4_w4a8_pipe_kernel, scalars, (head,) + tuple(config[1:3]), config[3], grouped=True,
                        row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                        extra_signature=dict(x_scale_ptr="*fp32"),
                        extra_constants=dict(STAGES=config[4], **({"BLOCK_M_TAIL": tail} if tail else {}),
                                             **({"W_IL": weight_interleave} if weight_interleave > 1 else {})))


def w4a8_pipe_supported(x: torch.Tensor, data: torch.Tensor, weight_interleave: int = 1) -> bool:
    """Whether :func:`launch_nvfp4_w4a8_pipe` runs this GEMM: sm_90 CUDA, K % 256 == 0 (the 128-K step, and scale
    rows the compiler can prove 16-byte aligned), row-major or 4-row interleaved weights, 16-byte aligned x rows."""
    from .nvfp4_gluon_jit import _capability

    if not (GLUON_AVAILABLE and x.is_cuda and _capability(x.device.index or 0)[0] == 9):
        return False
    k = 2 * data.shape[-1]
    return (k % 256 == 0 and weight_interleave in (1, 4) and data.is_contiguous() and data.data_ptr() % 16 == 0
            and x.data_ptr() % 16 == 0)


def launch_nvfp4_w4a8_pipe(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
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
    config=None,
    error_word: torch.Tensor | None = None,
    row_lo: int = 0,
    row_hi: int | None = None,
    own_pad: bool = True,
    weight_interleave: int = 1,
) -> torch.Tensor:
    """Launch the pipelined W4A8 grouped GEMM (inputs validated by ``megamoe.ops.gemm``; contract of
    :func:`megamoe.kernels.gemm.nvfp4_w4a8.launch_nvfp4_w4a8`, grouped only). ``row_lo`` / ``row_hi``: only the
    experts with ``row_lo < rows <= row_hi`` (a band; the others' rows are left untouched); ``own_pad``: write zeros
    to the padding rows ``[offsets[E-1], T)``.

    xq (S, K) float8_e4m3fn **in the FP8 MMA K order** (``launch_fp8_act_quant(..., mma_order=True)``; contiguous),
    x_scale (S,) float32. data (E, N, K//2) uint8 row-major, block_scale (E, N, K//16) float8_e4m3fn, global_scale
    0-d, (E, 1, 1) or (E, N, 1) fp32, expert_offsets (E,) int32, out (T, N) bf16 or (T, N//2) with ``swiglu``.
    ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES), default :data:`W4A8_PIPE_CONFIG`; BLOCK_M (token
    rows per tile) a power of two or the sum of two (96 = 64 + 32: two wgmmas on the same decoded weights).
    ``weight_interleave`` (1 or 4): ``data`` and ``block_scale`` hold groups of that many rows interleaved per 128-K
    step (:func:`megamoe.format.layouts.interleave_weight_rows`); the same bits as the row-major layout.
    """
    if expert_offsets is None:
        raise ValueError("expert_offsets: this kernel is grouped only")
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0]
    if num_rows == 0 or n == 0:
        return out
    if k % 256:
        raise ValueError(f"data: K={k} must be a multiple of 256 for this kernel")
    check_weight_interleave(weight_interleave, data)
    block_m, block_n, block_k, num_warps, stages = config or W4A8_PIPE_CONFIG
    m_tiles_bound = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows // (row_lo + 1)) + 1
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    programs = min(work_bound, _num_sms(xq.device.index or 0))
    head, strides, flags = kernel_arguments(xq, data, block_scale, global_scale, out, expert_offsets=expert_offsets,
                                            row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                                            error_word=error_word)
    head_m, tail_m = split_tile_rows(block_m)
    _nvfp4_w4a8_pipe_kernel[(programs,)](
        *head, programs, x_scale, row_lo, ROW_HI_UNBOUNDED if row_hi is None else row_hi, int(own_pad), *strides,
        BLOCK_M=head_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts + 1)), num_warps=num_warps, STAGES=stages,
        **flags, **({"BLOCK_M_TAIL": tail_m} if tail_m else {}),
        **({"W_IL": weight_interleave} if weight_interleave > 1 else {}))
    return out
