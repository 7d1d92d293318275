"""Decode-shaped NVFP4 x bf16 GEMMs (few rows per expert) on CUDA cores: dense and grouped.

One kernel family, one launcher (:func:`launch_nvfp4_gemv`).

Why a second kernel: at 1-64 tokens the grouped GEMM of ``nvfp4_gemm.py`` feeds
the tensor cores with at most a few real rows per 16-row MMA tile, and its cost
is the per-weight instruction stream (decode + repacking into the wgmma operand
layout + replicated scale loads), not the MMA. Here no ``tl.dot`` is used, so
the decoded weights never need an operand layout: each program owns one expert
and ``BLOCK_N`` output features, streams that weight slab once per group of
``ROWS`` token rows, decodes every weight once (the exact bf16 decode of
``nvfp4_gemm``: ``e2m1 * block_scale * 2**-8``), widens it to fp32 and
accumulates ``w * x`` with fp32 FMAs for the ``ROWS`` rows, reducing over K
inside the program (no split-K, no atomics: deterministic).

Grid (grouped): ``(cdiv(N, BLOCK_N), min(E, T) + 1)``. The second axis is a
*slot*: slot ``j < min(E, T)`` takes the ``j``-th non-empty expert, found on the
device from ``expert_offsets`` (prefix count of non-empty experts, built in
registers), so programs of empty experts never touch weights and the grid is
sized from host-known values only (sync-free, CUDA-graph capturable; the
routing may change between replays). The last slot writes zeros to the padding
rows ``[offsets[E-1], T)``. An expert with more than ``ROWS`` rows loops over
its rows in groups of ``ROWS`` (any count is correct; each extra group streams
the slab again, from L2 when it is still there).

Dense (``expert_offsets is None``): one slot, rows ``[0, M)``, optional bias.

Epilogues: ``global_scale`` (0-d, per expert (E, 1, 1), per row (E, N, 1) /
(N, 1)) times ``2**8``, bias (dense), fused SwiGLU with optional clamp on the
interleaved gate/up layout (row 2j = gate j, row 2j+1 = up j), row gather
(``row_index``) fused into the activation loads.

Triton interpreter (CPU tests, ``INTERPRET`` constexpr): same workarounds as
``nvfp4_gemm`` (while loops instead of tensor-bounded ranges, the fp32 form of
the decode, explicit round-to-nearest-even bf16 cast); the GPU path uses the
inline-PTX decode and the hardware E4M3 conversion (sm_90).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_gemm import gemm_error_word, global_scale_strides
from ..nvfp4_jit import decode_e2m1_pairs_portable, e4m3_scale_factor_2p118, round_to_bf16

# ---------------------------------------------------------------------------
# Tile configurations. Key: upper bound on the average rows per touched expert
# (host-known: ceil(T / min(E, T)); M for dense); the first key >= it wins.
# Values: (ROWS, BLOCK_N, BLOCK_K, num_warps, num_stages, maxnreg).
#   ROWS: token rows accumulated per pass over the weight slab (the decode is
#     shared by the ROWS rows; registers grow with ROWS * BLOCK_N * BLOCK_K).
#   BLOCK_N: weight rows per program; small, so that 8 touched experts (1
#     token, top-8) still give >= 512 programs for 132 SMs.
#   maxnreg: register cap (None: compiler's choice), so that 4 (ROWS=1) / 3
#     (ROWS=2) programs of 4 warps fit per SM; with this decode the compiler
#     already stays under it (128 / 165), the cap guards the occupancy that the
#     H100 sweep showed matters (a 162-register variant ran 87 us instead of 67).
#   num_stages is unused (no tl.dot, so no pipelining: the loop double-buffers by hand).
# SASS per K step, offline ptxas for sm_90 (instructions per weight per pass):
# (1, 64, 256, 4) 5.3 (128 registers), (2, 64, 256, 4) 6.6 for two rows (165 registers).
# H100 sweep: benchmarks/results/gemm_v5.md, benchmarks/NOTES_gemm.md.
# ---------------------------------------------------------------------------
GEMV_CONFIGS = {
    1: (1, 64, 256, 4, 1, 128),
    2: (2, 64, 256, 4, 1, 168),
    4: (4, 32, 128, 2, 1, None),
    1 << 62: (8, 32, 128, 4, 1, None),
}
# Interpreter (CPU tests): tiny tiles so that the N/K edges, several row groups
# per expert and the padding slot are all exercised.
INTERPRETER_GEMV_CONFIG = (2, 16, 64, 4, 1, None)


# Routing (used by megamoe/ops/gemm.py on CUDA tensors; host-known values only).
# Grouped: T <= GEMV_MAX_ROWS_PER_EXPERT * E, i.e. at most that many rows per
# expert on average (top-8 of 256 experts: up to 64 tokens at 2). Dense: M <=
# GEMV_MAX_DENSE_ROWS. Set from the H100 measurements in benchmarks/NOTES_gemm.md
# (gemm_v5_explore / gemm_v5): grouped, faster than the tensor-core kernel at
# 1, 8 and 64 tokens of top-8 / 256 experts (T = 0.03E, 0.25E, 2E); dense,
# faster at M = 1, 2 and slower at M >= 4 (only N/BLOCK_N programs, no split-K).
GEMV_MAX_ROWS_PER_EXPERT = 2
GEMV_MAX_DENSE_ROWS = 2


def gemv_preferred(num_rows: int, num_experts: int | None, n: int, k: int) -> bool:
    """Whether the decode kernel is the faster choice for this shape (``num_experts`` None: dense)."""
    if k % 32:
        return False
    if num_experts is None:
        return num_rows <= GEMV_MAX_DENSE_ROWS
    return num_rows <= GEMV_MAX_ROWS_PER_EXPERT * num_experts


def gemv_supports(x: torch.Tensor, data: torch.Tensor) -> bool:
    """Alignment the int32 views need: x rows and packed weight rows start on 4-byte boundaries."""
    return (x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0 and x.stride(1) == 1
            and data.data_ptr() % 4 == 0 and data.is_contiguous() and data.shape[-1] % 4 == 0)


def select_gemv_config(rows_per_expert: int, interpreter: bool):
    """(ROWS, BLOCK_N, BLOCK_K, num_warps, num_stages, maxnreg) for ``rows_per_expert`` average rows."""
    if interpreter:
        return INTERPRETER_GEMV_CONFIG
    for bound, config in GEMV_CONFIGS.items():
        if rows_per_expert <= bound:
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


@triton.jit
def _decode_fp32_asm(packed, factor):
    """GPU decode: int32 words of 4 packed bytes -> 8 fp32 weights ``e2m1 * scale * 2**-8`` (exact).

    packed: int32 tensor (bytes b0..b3 = K elements 8j..8j+7 of word j);
    factor: fp32 ``scale * 2**118`` of the word's 16-element block. Returns 8
    tensors: K elements 8j, 8j+2, 8j+4, 8j+6 (low nibbles) then 8j+1, 8j+3,
    8j+5, 8j+7 (high nibbles). Per word: ``prmt`` puts (b0, b1) and (b2, b3) in
    the two 16-bit halves; per half-pair of nibbles one ``and`` isolates the
    nibble, one integer multiply by ``2**6 + 2**12`` (even; ``2**2 + 2**8``
    odd) writes copies at two offsets that do not overlap, so that a second
    ``and`` keeps the E2M1 magnitude at bf16 bits 6-8 and the sign at bit 15:
    ``e2m1 * 2**-126`` as a bf16x2 pair (0.5 is a bf16 subnormal). One
    ``mul.rn.bf16x2`` by the bf16 factor makes it ``e2m1 * scale * 2**-8``
    exactly (sm_90 bf16 arithmetic keeps subnormals); a shift / an ``and``
    widen each half to fp32 (exact). 27 instructions per 8 weights.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, a, p, s;
        cvt.rn.bf16x2.f32 s, $8, $8;
        prmt.b32 t0, $9, 0, 0x7170;
        prmt.b32 t1, $9, 0, 0x7372;
        and.b32 a, t0, 0x000F000F;
        mul.lo.u32 a, a, 4160;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 p, a, s;
        shl.b32 $0, p, 16;
        and.b32 $1, p, 0xFFFF0000;
        and.b32 a, t1, 0x000F000F;
        mul.lo.u32 a, a, 4160;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 p, a, s;
        shl.b32 $2, p, 16;
        and.b32 $3, p, 0xFFFF0000;
        and.b32 a, t0, 0x00F000F0;
        mul.lo.u32 a, a, 260;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 p, a, s;
        shl.b32 $4, p, 16;
        and.b32 $5, p, 0xFFFF0000;
        and.b32 a, t1, 0x00F000F0;
        mul.lo.u32 a, a, 260;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 p, a, s;
        shl.b32 $6, p, 16;
        and.b32 $7, p, 0xFFFF0000;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
        args=[factor, packed],
        dtype=(tl.float32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit(do_not_specialize=["num_rows", "num_src_rows"])
def _nvfp4_gemv_kernel(
    x32_ptr, row_index_ptr, w32_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
    num_rows, N, K, num_experts, swiglu_limit, num_src_rows,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUPED: tl.constexpr, HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
    ERR_FLAG: tl.constexpr,
):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    num_slots = tl.num_programs(1)

    if GROUPED:
        lane = tl.arange(0, BLOCK_E)
        ends = tl.load(offsets_ptr + lane, mask=lane < num_experts, other=0)
        starts = tl.load(offsets_ptr + lane - 1, mask=(lane >= 1) & (lane < num_experts), other=0)
        ends = tl.minimum(tl.maximum(ends, 0), num_rows)
        starts = tl.minimum(tl.maximum(starts, 0), num_rows)
        active = (ends > starts) & (lane < num_experts)
        rank = tl.cumsum(active.to(tl.int32), 0)  # 1-based rank of each non-empty expert
        here = (active & (rank == slot + 1))[:, None, None]
        # one cross-warp reduction for (expert + 1, row start, row end) of this slot's expert
        info = tl.join(tl.join(lane + 1, starts), tl.join(ends, tl.zeros_like(lane)))
        info = tl.sum(tl.where(here, info, 0), axis=0)  # (2, 2)
        first, second = tl.split(info)
        expert_p1, row_start = tl.split(first)
        row_end, _ = tl.split(second)
        found = expert_p1 > 0
        expert = tl.maximum(expert_p1 - 1, 0)
        # the last slot owns the padding rows [offsets[E-1], T): zeros, no weight traffic
        last_end = tl.minimum(tl.maximum(tl.load(offsets_ptr + num_experts - 1), 0), num_rows)
        is_pad = slot == num_slots - 1
        row_start = tl.where(is_pad, last_end, row_start)
        row_end = tl.where(is_pad, num_rows, tl.where(found, row_end, 0))
        k_len = tl.where(is_pad, 0, K)
        expert = expert.to(tl.int64)
    else:
        row_start = pid_n * 0  # a tensor: loop-carried below
        row_end = num_rows
        k_len = K
        expert = 0

    offs_r = tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, BLOCK_K // 16)
    offs_q = tl.arange(0, 4)
    cols = pid_n * BLOCK_N + offs_n
    col_mask = cols < N
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)  # clamp instead of masking the weight loads
    # Everything lives in 3-D (ROWS, BLOCK_N, K-words) tensors built from 3-D pointers, so
    # that the weight slab keeps its load layout (16 bytes per thread along K) through the
    # decode and the FMAs; only the small x chunk and scale bytes change layout. Weights are
    # read as int32 words (4 packed bytes = 8 K elements), which the decode takes as is.
    w_ptrs = w32_ptr + expert * stride_we + w_cols[None, :, None] * stride_wn + offs_w[None, None, :]
    s_ptrs = scale_ptr + expert * stride_se + w_cols[None, :, None] * stride_sn + offs_g[None, None, :]
    gscale = tl.load(global_scale_ptr + expert * stride_ge + w_cols * stride_gn) * 256.0  # decode carries 2**-8
    if HAS_BIAS:
        bias = tl.load(bias_ptr + w_cols).to(tl.float32)
    k_steps = (k_len + BLOCK_K - 1) // BLOCK_K

    r0 = row_start
    bad_rows = 0  # row_index values outside [0, num_src_rows) in computed rows (one flag at the end)
    while r0 < row_end:
        rows = r0 + offs_r
        row_mask = rows < row_end
        if HAS_ROW_INDEX:
            # an out-of-range row_index reads zero activations (the row is dropped) and is flagged
            src_rows = tl.load(row_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            if ERR_FLAG != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only)
                src_ok = (src_rows >= 0) & (src_rows < num_src_rows)
                bad_rows += tl.sum((row_mask & ~src_ok).to(tl.int32), 0)
                row_mask_x = row_mask & src_ok
                src_rows = tl.where(src_ok, src_rows, 0)
            else:
                row_mask_x = row_mask
        else:
            src_rows = rows.to(tl.int64)
            row_mask_x = row_mask
        # x read as int32 words, each one (even, odd) bf16 pair; weight word j pairs with x
        # words 4j..4j+3 (x element 2p in the low half of word p)
        x_ptrs = (x32_ptr + src_rows[:, None, None, None] * stride_xm
                  + 4 * offs_w[None, None, :, None] + offs_q[None, None, None, :])
        x_mask = row_mask_x[:, None, None, None]
        words, scale_bytes, xt = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, 0, K, BLOCK_K, EVEN_K)
        acc = _fma_k_loop(words, scale_bytes, xt, w_ptrs, s_ptrs, x_ptrs, x_mask, K, k_steps, ROWS, BLOCK_N, BLOCK_K,
                          EVEN_K, INTERPRET) * gscale[None, :]
        if HAS_BIAS:
            acc = acc + bias[None, :]
        acc = tl.where(k_len > 0, acc, 0.0)  # padding rows (the bias included) are zeros
        out_rows = rows.to(tl.int64)[:, None] * stride_om
        if SWIGLU:
            gate, up = tl.split(acc.reshape(ROWS, BLOCK_N // 2, 2))
            if HAS_LIMIT:
                gate = tl.where(gate > swiglu_limit, swiglu_limit, gate)
                up = tl.where(up > swiglu_limit, swiglu_limit, up)
                up = tl.where(up < -swiglu_limit, -swiglu_limit, up)
            y = gate / (1.0 + tl.exp(-gate)) * up
            half_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + out_rows + half_cols[None, :], round_to_bf16(y, INTERPRET),
                     mask=row_mask[:, None] & (half_cols < N // 2)[None, :])
        else:
            tl.store(out_ptr + out_rows + cols[None, :], round_to_bf16(acc, INTERPRET),
                     mask=row_mask[:, None] & col_mask[None, :])
        r0 += ROWS
    if HAS_ROW_INDEX:
        if ERR_FLAG != 0:
            tl.atomic_or(err_ptr, ERR_FLAG, mask=(bad_rows > 0) & (k_len > 0))


@triton.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               X_CACHE: tl.constexpr = None):
    """Weight words (1, BLOCK_N, BLOCK_K//8) int32, scale bytes (1, BLOCK_N, BLOCK_K//16) uint8,
    x pairs (ROWS, 1, BLOCK_K//8, 4) int32 of the K chunk starting at ``k0``. X_CACHE: the x loads' cache
    modifier (``".cg"`` for activations other SMs wrote during the same launch: megamoe/kernels/moe_fused_decode.py;
    None: the default)."""
    x_cache: tl.constexpr = "" if X_CACHE is None else X_CACHE
    if EVEN_K:
        xt = tl.load(x_ptrs + k0 // 2, mask=x_mask, other=0, cache_modifier=x_cache)
        words = tl.load(w_ptrs + k0 // 8)
        scale_bytes = tl.load(s_ptrs + k0 // 16)
    else:
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, BLOCK_K // 16)
        word_ok = (k0 // 8 + offs_w) < K // 8
        xt = tl.load(x_ptrs + k0 // 2, mask=x_mask & word_ok[None, None, :, None], other=0, cache_modifier=x_cache)
        words = tl.load(w_ptrs + k0 // 8, mask=word_ok[None, None, :], other=0)
        scale_bytes = tl.load(s_ptrs + k0 // 16, mask=((k0 // 16 + offs_g) < K // 16)[None, None, :], other=0)
    return words, scale_bytes, xt


@triton.jit
def _fma_k_loop(words, scale_bytes, xt, w_ptrs, s_ptrs, x_ptrs, x_mask, K, k_steps, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                X_CACHE: tl.constexpr = None):
    """The CUDA-core K loop of one row group, given step 0's loads (:func:`_load_step`: words, scale bytes, x pairs)
    -> (ROWS, BLOCK_N) fp32 sums of x * W (W carries 2**-8). fp32 partial sums per (row, feature, K word): FFMA
    chains in the loop, one reduction over K at the end. Hand double-buffering: the loads of step i+1 are issued
    before the FMAs of step i (Triton's pipeliner only stages loads that feed tl.dot); the step past the end re-loads
    the last step (always in bounds) and is discarded. K: the K bound of the loads' masks; X_CACHE as
    :func:`_load_step`'s."""
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    if INTERPRET:
        i = 0
        while i < k_steps:
            nxt = tl.minimum(i + 1, k_steps - 1) * BLOCK_K
            words_n, scale_n, xt_n = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, nxt, K, BLOCK_K, EVEN_K, X_CACHE)
            acc = _fma_step(acc, words, scale_bytes, xt, BLOCK_N, BLOCK_K, True)
            words, scale_bytes, xt = words_n, scale_n, xt_n
            i += 1
    else:
        for i in range(0, k_steps):
            nxt = tl.minimum(i + 1, k_steps - 1) * BLOCK_K
            words_n, scale_n, xt_n = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, nxt, K, BLOCK_K, EVEN_K, X_CACHE)
            acc = _fma_step(acc, words, scale_bytes, xt, BLOCK_N, BLOCK_K, False)
            words, scale_bytes, xt = words_n, scale_n, xt_n
    return tl.sum(acc, axis=2)


@triton.jit
def _decode_fp32_portable(words, factor):
    """Interpreter form of :func:`_decode_fp32_asm` (same values, same output order)."""
    b0, b1, b2, b3 = (words & 0xFF), ((words >> 8) & 0xFF), ((words >> 16) & 0xFF), ((words >> 24) & 0xFF)
    e0, o0 = decode_e2m1_pairs_portable(b0, factor)
    e1, o1 = decode_e2m1_pairs_portable(b1, factor)
    e2, o2 = decode_e2m1_pairs_portable(b2, factor)
    e3, o3 = decode_e2m1_pairs_portable(b3, factor)
    return (e0.to(tl.float32), e1.to(tl.float32), e2.to(tl.float32), e3.to(tl.float32),
            o0.to(tl.float32), o1.to(tl.float32), o2.to(tl.float32), o3.to(tl.float32))


@triton.jit
def _fma_step(acc, words, scale_bytes, xt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """acc (ROWS, BLOCK_N, BLOCK_K//8) fp32 += the 8 products x * W of each K word (W carries 2**-8)."""
    if INTERPRET:
        factor = e4m3_scale_factor_2p118(scale_bytes.to(tl.int32))
    else:
        # hardware e4m3 -> f32 (exact; 0x7F/0xFF -> NaN), times 2**118 (exact): pairs with the bit-trick decode
        factor = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e35
    # two K words per 16-element scale block
    factor = tl.broadcast_to(factor[:, :, :, None], (1, BLOCK_N, BLOCK_K // 16, 2)).reshape(1, BLOCK_N, BLOCK_K // 8)
    if INTERPRET:
        w0, w2, w4, w6, w1, w3, w5, w7 = _decode_fp32_portable(words, factor)
    else:
        w0, w2, w4, w6, w1, w3, w5, w7 = _decode_fp32_asm(words, factor)
    # x pair q of the word (K elements 2q, 2q+1); bf16 -> fp32 by bit placement (exact)
    x_lo, x_hi = tl.split(xt.reshape(xt.shape[0], 1, BLOCK_K // 8, 2, 2))  # pairs (0, 2) and (1, 3)
    p0, p2 = tl.split(x_lo)
    p1, p3 = tl.split(x_hi)
    acc += w0 * (p0 << 16).to(tl.float32, bitcast=True)
    acc += w1 * (p0 & -65536).to(tl.float32, bitcast=True)
    acc += w2 * (p1 << 16).to(tl.float32, bitcast=True)
    acc += w3 * (p1 & -65536).to(tl.float32, bitcast=True)
    acc += w4 * (p2 << 16).to(tl.float32, bitcast=True)
    acc += w5 * (p2 & -65536).to(tl.float32, bitcast=True)
    acc += w6 * (p3 << 16).to(tl.float32, bitcast=True)
    acc += w7 * (p3 & -65536).to(tl.float32, bitcast=True)
    return acc


def launch_nvfp4_gemv(
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
) -> torch.Tensor:
    """Launch the decode-shaped NVFP4 GEMM (inputs already validated by ``megamoe.ops.gemm``).

    Same contract as :func:`megamoe.kernels.gemm.nvfp4_gemm.launch_nvfp4_gemm` (row_index drop rule and
    error flag included).
    Dense (``expert_offsets is None``): x (M, K) bf16; data (N, K//2) uint8 (low
    nibble = even element); block_scale (N, K//16) float8_e4m3fn; global_scale
    0-d or (N, 1) fp32; bias None or (N,); out (M, N) bf16. Grouped: x (T, K)
    bf16 sorted by expert, or (S, K) with ``row_index`` (T,) int32; data
    (E, N, K//2); block_scale (E, N, K//16); global_scale 0-d, (E, 1, 1) or
    (E, N, 1) fp32; expert_offsets (E,) int32 cumulative row ends (device);
    out (T, N) bf16, or (T, N//2) with ``swiglu``. Last dimensions contiguous,
    K a multiple of 32; x and data 4-byte aligned (:func:`gemv_supports`).
    ``config``: (ROWS, BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg]),
    else :func:`select_gemv_config`.
    """
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    # host-known average rows per touched expert (at most min(E, T) experts are touched)
    rows_per_expert = triton.cdiv(num_rows, min(num_experts, num_rows)) if grouped else num_rows
    config = tuple(config or select_gemv_config(rows_per_expert, interpreter))
    rows, block_n, block_k, num_warps, num_stages = config[:5]
    maxnreg = config[5] if len(config) > 5 else None
    extra = {"maxnreg": maxnreg} if maxnreg is not None and not interpreter else {}
    slots = min(num_experts, num_rows) + 1 if grouped else 1
    stride_ge, stride_gn = global_scale_strides(global_scale, grouped)
    scale_u8 = block_scale.view(torch.uint8)
    data32 = data.view(torch.int32)  # 4 packed bytes per word (K % 8 == 0, rows 4-byte aligned)
    grid = (triton.cdiv(n, block_n), slots)
    err, err_flag = gemm_error_word(out.device, error_word)
    _nvfp4_gemv_kernel[grid](
        x.view(torch.int32), row_index if row_index is not None else x, data32, scale_u8, global_scale,
        expert_offsets if grouped else x, bias if bias is not None else x, out, err,
        num_rows, n, k, num_experts, float(swiglu_limit) if swiglu_limit is not None else 0.0, x.shape[0],
        x.stride(0) // 2, data32.stride(0) if grouped else 0, data32.stride(-2),
        scale_u8.stride(0) if grouped else 0, scale_u8.stride(-2), stride_ge, stride_gn, out.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(num_experts) if grouped else 1,
        GROUPED=grouped, HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, EVEN_K=k % block_k == 0, INTERPRET=interpreter,
        ERR_FLAG=err_flag, num_warps=num_warps, num_stages=num_stages, **extra,
    )
    return out
