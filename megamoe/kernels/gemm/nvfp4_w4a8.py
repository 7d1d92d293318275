"""W4A8 grouped / dense GEMM for Hopper: NVFP4 weights decoded in registers to FP8 E4M3, FP8 activations,
FP8 tensor cores (wgmma ``.e4m3``), fp32 accumulation.

One kernel, one launcher (:func:`launch_nvfp4_w4a8`). Same structure as the bf16 tensor-core kernel
(``nvfp4_gemm.py``): swap-AB (``out^T = W @ x^T``: the decoded weight tile (BLOCK_N, 128) is wgmma's
register operand A, the FP8 activation tile x^T (128, BLOCK_M) is operand B, staged through shared memory by
the software pipeline; the activation rows are K-major as FP8 wgmma needs), the persistent sync-free
grouped schedule over ``expert_offsets``, the fused ``row_index`` gather (with the device-guard flag), and
the bias / SwiGLU + clamp epilogue.

Numerics (``megamoe/reference/w4a8.py`` is the oracle): per K step of 128 and weight row n, the eight E4M3
block scales s_j give ``S = pow2ceil(max_j |s_j|)``; the operand is ``e4m3_rne(e2m1 * s_j / S)`` (computed
exactly in f16, rounded once by ``cvt.rn.satfinite.e4m3x2.f16x2``). Each K step's wgmma result (summed by
the tensor core from zero) is promoted into the fp32 accumulator as ``acc += partial * S[n]`` (one FFMA per
element), the DeepSeek promotion every 128 K that also bounds the Hopper FP8 accumulator's reduced
precision. Epilogue: ``acc * s_x[m] * global_scale[n]`` (s_x the per-token activation scale), then bias or
SwiGLU, one bf16 rounding. Requires K % 128 == 0.

Weight decode on the GPU (:func:`_decode_fp8_pairs_sm90`, inline PTX): per 4 packed bytes, ``prmt`` spreads
the bytes into 16-bit halves, shift/``lop3`` place each nibble as the f16 ``e2m1 * 2**-14`` (sign at bit
15), one ``mul.rn.f16x2`` by ``(s_j / S) * 2**14`` (exact), one ``cvt.rn.satfinite.e4m3x2.f16x2`` per two
weights: about 3.5 instructions per weight. No FP8 copy of the weights exists anywhere.

Triton interpreter (CPU tests, ``INTERPRET``): the decode runs in fp32 with the integer E4M3 encoder
(same bits), the FP8 operands are decoded back to fp32 (exact) and multiplied with an fp32 ``tl.dot``
(the interpreter has no FP8 dot); loops are while loops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..nvfp4_jit import e2m1_decode, e4m3_decode, e4m3_encode, round_to_bf16, sign_bit
from .nvfp4_gemm import _num_sms, _tile_table, _work_rows, gemm_error_word, global_scale_strides, swiglu_clamped

#: K per step: one activation/weight FP8 tile, eight NVFP4 block scales per weight row, one promotion.
W4A8_BLOCK_K = 128

# ---------------------------------------------------------------------------
# Tile configurations, keyed by rows per expert (T / E grouped, M dense); the first key >= it wins.
# Values: (BLOCK_M tokens, BLOCK_N weight rows, SPLIT_M token sub-tiles, num_warps, num_stages,
# programs_per_sm).
# Not tuned on a GPU yet (benchmarks/NOTES_gemm.md "w4a8 v1"): chosen from the register budget
# (sm_90 offline compile: no spills) and the promotion's cost. num_warps = 8: two warpgroups, each a
# 64-row wgmma slice of the weight tile, so one warpgroup's decode overlaps the other's MMA.
# ---------------------------------------------------------------------------
W4A8_CONFIGS = {
    96: (64, 128, 1, 8, 3, 1),
    1 << 62: (128, 128, 2, 8, 2, 1),
}
INTERPRETER_CONFIG = (32, 32, 2, 4, 1, 1)
INTERPRETER_PROGRAMS = 3
#: Below this many rows per expert on average (host shapes), ``mode="w4a8"`` keeps the w4a16 kernels on
#: CUDA (``megamoe.ops.gemm``): decode-sized GEMMs are weight-bandwidth bound, FP8 MMA buys nothing there.
#: 48 (not measured yet; set it from ``bench_gemm.py --w4a8`` and a decode-size sweep): V4-Flash (256 experts
#: + the stacked shared group, top-6) switches at about 2060 tokens, V4-Pro (384 + 1, top-6) at about 3080, so
#: both run FP8 at 4096 tokens.
W4A8_MIN_ROWS_PER_EXPERT = 48


def select_w4a8_config(rows_per_expert: int, interpreter: bool):
    """Pick (BLOCK_M, BLOCK_N, SPLIT_M, num_warps, num_stages, programs_per_sm)."""
    if interpreter:
        return INTERPRETER_CONFIG
    for bound, config in W4A8_CONFIGS.items():
        if rows_per_expert <= bound:
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


@triton.jit
def _decode_fp8_pairs_sm90(packed, factor):
    """4 packed bytes -> 4 even + 4 odd E4M3 operands ``e4m3_rne(e2m1 * factor * 2**-14)``.

    packed: (BLOCK_N, 64) uint8; factor: (BLOCK_N, 64) float32 ``(s_j / S) * 2**14`` per byte, in
    [2**-4, 2**14] (exact in f16). The f16 product ``e2m1 * 2**-14 * factor`` is exact (<= 6 significant
    bits, >= 2**-19, f16 keeps subnormals), so the cvt is the only rounding.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, a, b, s0, s1, z;
        .reg .b16 e01, e23, o01, o23;
        mov.b32 z, 0;
        cvt.rn.f16x2.f32 s0, $4, $3;
        cvt.rn.f16x2.f32 s1, $6, $5;
        prmt.b32 t0, $2, z, 0x7170;
        prmt.b32 t1, $2, z, 0x7372;
        shl.b32 a, t0, 9;
        and.b32 b, t0, 0x00080008;
        shl.b32 b, b, 12;
        lop3.b32 a, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 a, a, s0;
        cvt.rn.satfinite.e4m3x2.f16x2 e01, a;
        shl.b32 a, t1, 9;
        and.b32 b, t1, 0x00080008;
        shl.b32 b, b, 12;
        lop3.b32 a, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 a, a, s1;
        cvt.rn.satfinite.e4m3x2.f16x2 e23, a;
        shl.b32 a, t0, 5;
        and.b32 b, t0, 0x00800080;
        shl.b32 b, b, 8;
        lop3.b32 a, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 a, a, s0;
        cvt.rn.satfinite.e4m3x2.f16x2 o01, a;
        shl.b32 a, t1, 5;
        and.b32 b, t1, 0x00800080;
        shl.b32 b, b, 8;
        lop3.b32 a, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 a, a, s1;
        cvt.rn.satfinite.e4m3x2.f16x2 o23, a;
        mov.b32 $0, {e01, e23};
        mov.b32 $1, {o01, o23};
        }
        """,
        constraints="=r,=r,r,r,r,r,r",
        args=[packed, factor],
        dtype=(tl.float8e4nv, tl.float8e4nv),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fp8_operand_portable(code, ratio):
    """Interpreter decode: E2M1 code (int32 0..15) x ratio s_j / S -> the E4M3 operand's float32 value."""
    v = e2m1_decode(code) * ratio  # exact
    byte = e4m3_encode(tl.abs(v)) | (sign_bit(v) << 7)
    return e4m3_decode(byte)


@triton.jit
def _weight_step(w_ptrs, s_ptrs, kt, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight K step ``kt``: (operands (BLOCK_N, 128) fp8 (fp32 values in the interpreter), S (BLOCK_N,) fp32)."""
    packed = tl.load(w_ptrs + kt * 64)  # (BLOCK_N, 64) uint8
    sbytes = tl.load(s_ptrs + kt * 8).to(tl.int32)  # (BLOCK_N, 8)
    if INTERPRET:
        sf = e4m3_decode(sbytes)
    else:
        sf = sbytes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    is_nan = (sbytes & 0x7F) == 0x7F
    sf = tl.where(is_nan, 0.0, sf)
    any_nan = tl.max(is_nan.to(tl.int32), 1) > 0
    smax = tl.max(tl.abs(sf), 1)  # |s|: a negative scale byte (not written by quantizers) flips signs exactly
    bits = smax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    positive = smax > 0.0
    big_s = tl.where(positive, (exponent << 23).to(tl.float32, bitcast=True), 1.0)
    inv_s = tl.where(positive, ((254 - exponent) << 23).to(tl.float32, bitcast=True), 1.0)
    big_s = tl.where(any_nan, float("nan"), big_s)
    ratio = sf * inv_s[:, None]  # (BLOCK_N, 8) in [-1, 1], exact; 0 for NaN groups (the row's S is NaN)
    if INTERPRET:
        r = tl.broadcast_to(ratio[:, :, None], (BLOCK_N, 8, 8)).reshape(BLOCK_N, 64)
        p = packed.to(tl.int32)
        even = _fp8_operand_portable(p & 0xF, r)
        odd = _fp8_operand_portable(p >> 4, r)
    else:
        factor = tl.broadcast_to((ratio * 16384.0)[:, :, None], (BLOCK_N, 8, 8)).reshape(BLOCK_N, 64)
        even, odd = _decode_fp8_pairs_sm90(packed, factor)
    w = tl.join(even, odd).reshape(BLOCK_N, 128)  # low nibble = even K element
    return w, big_s


@triton.jit
def _token_rows(row_index_ptr, rows, row_mask, is_real, num_src_rows, HAS_ROW_INDEX: tl.constexpr,
                ERR_FLAG: tl.constexpr):
    """(source rows (int64), activation mask, count of out-of-range row_index values) of a token sub-tile."""
    bad = 0
    if HAS_ROW_INDEX:
        # an out-of-range row_index reads zero activations (the row is dropped) and is flagged
        src_rows = tl.load(row_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        if ERR_FLAG != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only)
            src_ok = (src_rows >= 0) & (src_rows < num_src_rows)
            bad = tl.sum((row_mask & ~src_ok & is_real).to(tl.int32), 0)
            x_mask = row_mask & src_ok
            src_rows = tl.where(src_ok, src_rows, 0)
        else:
            x_mask = row_mask
    else:
        src_rows = rows.to(tl.int64)
        x_mask = row_mask
    return src_rows, x_mask, bad


@triton.jit
def _epilogue(acc, xs_ptr, row_index_ptr, row_start, row_end, num_src_rows, gscale, bias_ptr, cols, col_mask,
              n_start, is_real, out_ptr, stride_om, N, swiglu_limit, BLOCK_N: tl.constexpr, SUB_M: tl.constexpr,
              HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
              INTERPRET: tl.constexpr, ERR_FLAG: tl.constexpr):
    """acc (BLOCK_N, SUB_M) -> ``acc * s_x * global_scale`` (+ bias | SwiGLU), one bf16 rounding, stored.

    The token rows (and their row_index entries) are re-read here rather than kept live across the K loop:
    64 int64 source rows in the accumulator's layout would cost 32 registers per sub-tile.
    """
    rows = row_start + tl.arange(0, SUB_M)
    row_mask = rows < row_end
    src_rows, x_mask, _ = _token_rows(row_index_ptr, rows, row_mask, is_real, num_src_rows, HAS_ROW_INDEX,
                                      ERR_FLAG)
    x_scale = tl.load(xs_ptr + src_rows, mask=x_mask, other=0.0)
    acc = (acc * x_scale[None, :]) * gscale[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc + bias[:, None]
    acc = tl.where(is_real, acc, 0.0)
    result = tl.trans(acc)  # (SUB_M, BLOCK_N)
    out_rows = rows.to(tl.int64)[:, None] * stride_om
    if SWIGLU:
        gate, up = tl.split(result.reshape(SUB_M, BLOCK_N // 2, 2))
        y = swiglu_clamped(gate, up, swiglu_limit, HAS_LIMIT)
        half_cols = n_start // 2 + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + out_rows + half_cols[None, :], round_to_bf16(y, INTERPRET),
                 mask=row_mask[:, None] & (half_cols < N // 2)[None, :])
    else:
        tl.store(out_ptr + out_rows + cols[None, :], round_to_bf16(result, INTERPRET),
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _promote_step(acc, w, big_s, x_ptrs, x_mask, kt, INTERPRET: tl.constexpr):
    """acc (BLOCK_N, SUB_M) += (W step kt @ x^T step kt) * S: one FP8 wgmma chain from zero, one FFMA each."""
    if INTERPRET:  # no FP8 dot in the interpreter: exact fp32 values of the FP8 operands
        xt = e4m3_decode(tl.load(x_ptrs + kt * 128, mask=x_mask[None, :], other=0))
        part = tl.dot(w, xt, input_precision="ieee")
    else:
        xt = tl.load(x_ptrs + kt * 128, mask=x_mask[None, :], other=0.0)
        part = tl.dot(w, xt)
    return part * big_s[:, None] + acc


# num_rows / num_programs / num_src_rows change per call: not specialised (no recompiles across batch sizes).
@triton.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows"])
def _nvfp4_w4a8_kernel(
    xq_ptr, xs_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
    num_rows, N, K, num_experts, swiglu_limit, num_programs, num_src_rows,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_M: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUPED: tl.constexpr, HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr,
    ERR_FLAG: tl.constexpr,
):
    """Token tiles of BLOCK_M rows are computed as SPLIT_M (1 or 2) sub-tiles of SUB_M rows sharing one
    decoded weight tile: two accumulators but one live wgmma partial, so a 128-token tile fits the
    register file (sm_90 offline compile, no spills)."""
    SUB_M: tl.constexpr = BLOCK_M // SPLIT_M
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    lane, starts, ends, tiles, tile_ends, total_tiles = _tile_table(offsets_ptr, num_rows, num_experts, BLOCK_M,
                                                                    BLOCK_E, GROUPED)
    total_work = total_tiles * n_tiles

    offs_m = tl.arange(0, SUB_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    offs_h = tl.arange(0, 64)
    offs_g = tl.arange(0, 8)
    k_tiles = K // 128

    # Persistent loop over work items (m-tile major, n-tile minor): concurrent programs share an expert's
    # m-tiles, so its weights stay in L2.
    work = pid
    bad_rows = 0  # row_index values outside [0, num_src_rows) seen by this program (one flag at the end)
    while work < total_work:
        tile = work // n_tiles
        n_start = (work % n_tiles) * BLOCK_N
        row_start, row_end, is_real, expert_c = _work_rows(tile, lane, tile_ends, tiles, starts, ends, num_experts,
                                                           num_rows, BLOCK_M, GROUPED)

        rows0 = row_start + offs_m
        row_mask0 = rows0 < row_end
        src_rows0, x_mask0, bad0 = _token_rows(row_index_ptr, rows0, row_mask0, is_real, num_src_rows,
                                               HAS_ROW_INDEX, ERR_FLAG)
        bad_rows += bad0
        x_ptrs0 = xq_ptr + src_rows0[None, :] * stride_xm + offs_k[:, None]  # (128, SUB_M), K-major rows
        if SPLIT_M == 2:
            rows1 = rows0 + SUB_M
            row_mask1 = rows1 < row_end
            src_rows1, x_mask1, bad1 = _token_rows(row_index_ptr, rows1, row_mask1, is_real, num_src_rows,
                                                   HAS_ROW_INDEX, ERR_FLAG)
            bad_rows += bad1
            x_ptrs1 = xq_ptr + src_rows1[None, :] * stride_xm + offs_k[:, None]
        cols = n_start + offs_n
        col_mask = cols < N
        if EVEN_N:
            w_cols = cols
        else:
            w_cols = tl.minimum(cols, N - 1)  # clamp instead of masking; the store masks the columns
        w_ptrs = w_ptr + expert_c * stride_we + w_cols[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
        s_ptrs = scale_ptr + expert_c * stride_se + w_cols[:, None].to(tl.int64) * stride_sn + offs_g[None, :]

        acc0 = tl.zeros((BLOCK_N, SUB_M), dtype=tl.float32)
        if SPLIT_M == 2:
            acc1 = tl.zeros((BLOCK_N, SUB_M), dtype=tl.float32)
        k_iters = tl.where(is_real, k_tiles, 0)
        if INTERPRET:
            # The interpreter cannot take a tensor as a range() bound (numpy >= 2): use a while loop.
            kt = 0
            while kt < k_iters:
                w, big_s = _weight_step(w_ptrs, s_ptrs, kt, BLOCK_N, True)
                acc0 = _promote_step(acc0, w, big_s, x_ptrs0, x_mask0, kt, True)
                if SPLIT_M == 2:
                    acc1 = _promote_step(acc1, w, big_s, x_ptrs1, x_mask1, kt, True)
                kt += 1
        else:
            for kt in range(0, k_iters):
                w, big_s = _weight_step(w_ptrs, s_ptrs, kt, BLOCK_N, False)
                acc0 = _promote_step(acc0, w, big_s, x_ptrs0, x_mask0, kt, False)
                if SPLIT_M == 2:
                    acc1 = _promote_step(acc1, w, big_s, x_ptrs1, x_mask1, kt, False)

        gscale = tl.load(
            global_scale_ptr + expert_c * stride_ge + cols.to(tl.int64) * stride_gn, mask=col_mask, other=0.0
        )
        _epilogue(acc0, xs_ptr, row_index_ptr, row_start, row_end, num_src_rows, gscale, bias_ptr, cols, col_mask,
                  n_start, is_real, out_ptr, stride_om, N, swiglu_limit, BLOCK_N, SUB_M, HAS_ROW_INDEX, HAS_BIAS,
                  SWIGLU, HAS_LIMIT, INTERPRET, ERR_FLAG)
        if SPLIT_M == 2:
            _epilogue(acc1, xs_ptr, row_index_ptr, row_start + SUB_M, row_end, num_src_rows, gscale, bias_ptr, cols,
                      col_mask, n_start, is_real, out_ptr, stride_om, N, swiglu_limit, BLOCK_N, SUB_M,
                      HAS_ROW_INDEX, HAS_BIAS, SWIGLU, HAS_LIMIT, INTERPRET, ERR_FLAG)
        work += num_programs
    if HAS_ROW_INDEX:
        if ERR_FLAG != 0:
            tl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)


def launch_nvfp4_w4a8(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
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
) -> torch.Tensor:
    """Launch the W4A8 GEMM (inputs validated by ``megamoe.ops.gemm``; K % 128 == 0).

    xq (S, K) float8_e4m3fn and x_scale (S,) float32 from ``launch_fp8_act_quant`` (rows sorted by expert,
    or gathered through ``row_index`` (T,) int32). Dense (``expert_offsets is None``): data (N, K//2) uint8,
    block_scale (N, K//16) float8_e4m3fn, global_scale 0-d or (N, 1) fp32, out (M, N) bf16. Grouped: data
    (E, N, K//2), block_scale (E, N, K//16), global_scale 0-d, (E, 1, 1) or (E, N, 1), expert_offsets (E,)
    int32, out (T, N) bf16 or (T, N//2) with ``swiglu``. Rows >= expert_offsets[E-1] are written as zeros;
    an out-of-range ``row_index`` reads zeros and sets the ``("nvfp4_grouped_mm", "row_index")`` flag.
    """
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    rows_per_expert = max(1, num_rows // num_experts) if grouped else num_rows
    block_m, block_n, split_m, num_warps, num_stages, per_sm = (
        config or select_w4a8_config(rows_per_expert, interpreter))
    m_tiles_bound = triton.cdiv(num_rows, block_m) + (num_experts + 1 if grouped else 0)
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    if interpreter:
        programs = min(work_bound, INTERPRETER_PROGRAMS)
    else:
        programs = min(work_bound, _num_sms(xq.device.index or 0) * per_sm)
    stride_ge, stride_gn = global_scale_strides(global_scale, grouped)
    scale_u8 = block_scale.view(torch.uint8)
    err, err_flag = gemm_error_word(out.device, error_word)
    xq_arg = xq.view(torch.uint8) if interpreter else xq
    _nvfp4_w4a8_kernel[(programs,)](
        xq_arg, x_scale, row_index if row_index is not None else x_scale, data, scale_u8, global_scale,
        expert_offsets if grouped else x_scale, bias if bias is not None else x_scale, out, err,
        num_rows, n, k, num_experts, float(swiglu_limit) if swiglu_limit is not None else 0.0, programs,
        xq.shape[0],
        xq.stride(0), data.stride(0) if grouped else 0, data.stride(-2),
        scale_u8.stride(0) if grouped else 0, scale_u8.stride(-2), stride_ge, stride_gn, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_M=split_m,
        BLOCK_E=triton.next_power_of_2(num_experts + 1) if grouped else 1,
        GROUPED=grouped, HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, EVEN_N=n % block_n == 0, INTERPRET=interpreter,
        ERR_FLAG=err_flag, num_warps=num_warps, num_stages=num_stages,
    )
    return out
