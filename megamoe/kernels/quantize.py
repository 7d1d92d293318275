"""Fused, sync-free NVFP4 quantize / dequantize Triton kernels.

Semantics are exactly those of ``megamoe/reference/quantize.py`` (bit for bit:
packed bytes, block-scale bytes and global-scale bits); every conversion goes
through the integer helpers of ``megamoe/kernels/nvfp4_jit.py`` and every
division is ``tl.div_rn`` with the products rounded in the reference's order
(``6 * global_scale`` then divide; ``block_scale * global_scale`` then divide).

Kernels (x is always a contiguous ``(M, K)`` view, K % 16 == 0, M > 0):

* ``_amax_partials_kernel``: per-tensor dynamic scale, pass 1. Program p
  writes the max |finite x| of a grid-strided set of chunks to
  ``partials[p]``; no atomics, no memset, deterministic.
* ``_quantize_tiles_kernel``: one (BLOCK_M, BLOCK_K) tile per program. The
  global scale is either given on the device (0-d or one per row; the
  calibrated single-pass path) or, for the per-tensor dynamic path, reduced by
  every program from the partials (pass 2; program (0, 0) also stores it).
* ``_quantize_rows_kernel``: per-row dynamic scale in one launch: each
  program owns BLOCK_M whole rows, computes their amax in a first sweep over
  K, stores the per-row global scale, then quantizes them in a second sweep
  (the rows are re-read, mostly from L2). With ``QUANTIZE=False`` it only
  computes the per-row global scale (``compute_global_scale``).
* ``_dequantize_kernel``: packed codes + scales -> float32/bf16/fp16.

Optional swizzled scale output: the quantize kernels can additionally write
the block-scale bytes into a ``(rows_p, cols_p)`` buffer in the 128x4
swizzled layout (``megamoe/format/layouts.py``); the grid then covers the
padded rows and columns, so padding entries are written as zero bytes by the
kernel itself (the caller's buffer need not be zeroed).

Launchers: ``launch_quantize`` (all quantize modes, and the scale-only
``compute_global_scale`` path) and its inverse ``launch_dequantize``. They take preallocated outputs and never read
device values on the host, so they are CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.constants import AMAX_FLOOR, BLOCK_SIZE, E4M3_NAN_BYTE, GLOBAL_SCALE_DIVISOR
from .nvfp4_jit import e2m1_decode, e4m3_decode, e4m3_encode

# ---------------------------------------------------------------------------
# Tile configurations: kind -> ((max_rows, config), ...), first bucket whose
# max_rows >= M wins; config = (BLOCK_M rows, BLOCK_K elements along K,
# num_warps), or for "amax" (BLOCK elements per chunk, num_warps, max partials).
# Chosen from the H100 sweep of ``benchmarks/bench_quantize.py --tune`` (results
# in benchmarks/results/quantize_*.md). The kernels are pure streaming; a tile
# of a few thousand elements per program keeps enough bytes in flight per SM,
# and few-row problems take 1-row tiles so that they still fill the machine.
#   "tiles":   single-pass kernel (given scale; per-tensor dynamic pass 2).
#   "rows":    per-row dynamic kernel (whole rows per program, 2 sweeps over K).
#   "dequant": dequantize kernel.
#   "amax":    per-tensor amax partials (pass 1).
# ---------------------------------------------------------------------------
QUANTIZE_CONFIGS = {
    # v2 sweep, 32768 x 7168 bf16: (2, 1024, 4) 359 us vs (8, 1024, 8) ~490 us; M <= 256: 1-row tiles
    "tiles": ((256, (1, 512, 4)), (1 << 62, (2, 1024, 4))),
    # v2 sweep: (2, 1024, 4) 428 us vs (1, 1024, 4) 468 us at 32768 rows; M = 1..128: (1, 2048, 8) ~10 us
    "rows": ((256, (1, 2048, 8)), (1 << 62, (2, 1024, 4))),
    # v2 sweep: (1, 1024, 4) best or within 2% everywhere
    "dequant": ((1 << 62, (1, 1024, 4)),),
    # v1/v2 sweeps: 8192-element chunks, 8 warps, <= 512 partials: 2770 GB/s at 32768 x 7168
    "amax": ((1 << 62, (8192, 8, 512)),),
}
# Small tiles for the Triton interpreter (CPU tests): several tiles per row and
# per column so that masking, multi-tile rows and the partial reduction are all
# exercised at small shapes.
INTERPRETER_CONFIGS = {
    "tiles": (4, 64, 4),
    "rows": (4, 64, 4),
    "dequant": (4, 64, 4),
    "amax": (256, 4, 512),
}

# Element kinds (quantize input / dequantize output): how a pair word maps to two float32.
_IN_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# Global-scale modes of ``_quantize_tiles_kernel``.
GS_GIVEN_SCALAR = 0
GS_GIVEN_PER_ROW = 1
GS_DYNAMIC_TENSOR = 2


@triton.jit
def _finite_abs(x):
    """|x| for finite x, 0 for NaN / +-Inf (float32)."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _global_scale_from_amax(amax, AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr):
    return tl.div_rn(tl.maximum(amax, AMAX_FLOOR_C), DIVISOR)


@triton.jit(do_not_specialize=["num_programs"])
def _amax_partials_kernel(
    x_ptr, partials_ptr, numel, num_programs, BLOCK: tl.constexpr, FINALIZE: tl.constexpr,
    AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr, NAN_BYTE: tl.constexpr,
):
    """partials[p] = max |finite x| over chunks p, p + P, p + 2P, ... of BLOCK elements.

    With FINALIZE (one program, x = the partials) it stores the global scale
    ``max(amax, AMAX_FLOOR) / 2688`` instead of the amax.
    """
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid.to(tl.int64) * BLOCK
    step = num_programs.to(tl.int64) * BLOCK
    while start < numel:
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _finite_abs(x))
        start += step
    amax = tl.max(acc, axis=0)
    if FINALIZE:
        amax = _global_scale_from_amax(amax, AMAX_FLOOR_C, DIVISOR)
    tl.store(partials_ptr + pid, amax)


@triton.jit
def _load_pairs(words_ptr, offsets, mask, IN_KIND: tl.constexpr):
    """Load (even, odd) elements as float32 from one word per pair (exact conversions).

    words: x reinterpreted as int32 pairs (IN_KIND 0: bf16, 1: fp16) or int64
    pairs (IN_KIND 2: fp32); the even element sits in the low half (little
    endian). One wide load per pair keeps the accesses vectorised without any
    register shuffles to separate even from odd elements.
    """
    w = tl.load(words_ptr + offsets, mask=mask, other=0)
    if IN_KIND == 0:
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = ((w >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        even = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        odd = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _e2m1_magnitude_code_fast(a):
    """Same result as ``nvfp4_jit.e2m1_magnitude_code`` for float32 a >= 0 (not NaN), in fewer instructions.

    a >= 1: saturate at 6, round the mantissa to 1 bit (nearest even) with an
    integer add; then (exponent, mantissa bit) is the code: 1 -> 2, 1.5 -> 3,
    2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7. a < 1: the code is RNE(2a) in {0, 1, 2},
    obtained exactly by adding 2**23 (2a is exact).
    """
    bits = tl.minimum(a, 6.0).to(tl.int32, bitcast=True)
    rounded = bits + 0x1FFFFF + ((bits >> 22) & 1)
    high = (rounded >> 22) - 252
    low = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a < 1.0, low, high)


@triton.jit
def _e2m1_codes(x, denom):
    """4-bit codes of x / denom (exact division, RNE, ties to even code; sign of x)."""
    magnitude = _e2m1_magnitude_code_fast(tl.abs(tl.div_rn(x, denom)))
    return magnitude | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _quantize_tile(
    words_ptr, data_ptr, scale_ptr, swz_ptr, gs, row0, k0, M, K, rows_p, cols_p,
    IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr,
    NAN_BYTE: tl.constexpr,
):
    """Quantize the (BLOCK_M, BLOCK_K) tile at (row0, k0); ``gs``: (BLOCK_M,) float32.

    Works on (BLOCK_M, BLOCK_K // 16, 8) pairs: axis 1 = 16-element block,
    axis 2 = pair within the block; the packed byte of a pair is
    ``code(even) | code(odd) << 4``.
    """
    NB: tl.constexpr = BLOCK_K // 16
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    blocks = k0 // 16 + tl.arange(0, NB)
    half_k = K // 2
    pcols = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8) pair index along the row
    row_ok = rows < M
    pmask = row_ok[:, None, None] & (pcols < half_k)[None, :, :]
    poffs = rows[:, None, None] * half_k + pcols[None, :, :]
    even, odd = _load_pairs(words_ptr, poffs, pmask, IN_KIND)

    a_even = tl.abs(even)
    a_odd = tl.abs(odd)
    fin_even = a_even < float("inf")
    fin_odd = a_odd < float("inf")
    block_amax = tl.maximum(tl.max(tl.where(fin_even, a_even, 0.0), axis=2),
                            tl.max(tl.where(fin_odd, a_odd, 0.0), axis=2))  # (BM, NB)
    block_bad = tl.max(((~fin_even) | (~fin_odd)).to(tl.int32), axis=2) > 0
    gs2 = gs[:, None]
    scale_f32 = tl.minimum(tl.div_rn(block_amax, gs2 * 6.0), 448.0)
    byte = e4m3_encode(scale_f32)
    scale_dec = e4m3_decode(byte)
    safe = (scale_dec > 0) & (~block_bad)
    denom = tl.where(safe, scale_dec * gs2, 1.0)[:, :, None]
    packed = _e2m1_codes(even, denom) | (_e2m1_codes(odd, denom) << 4)
    packed = tl.where(safe[:, :, None], packed, 0).to(tl.uint8)  # (BM, NB, 8)
    tl.store(data_ptr + poffs, packed, mask=pmask)

    byte = tl.where(block_bad, NAN_BYTE, byte).to(tl.uint8)
    num_blocks = K // 16
    smask = row_ok[:, None] & (blocks < num_blocks)[None, :]
    tl.store(scale_ptr + rows[:, None] * num_blocks + blocks[None, :], byte, mask=smask)
    if SWIZZLE:
        r = rows[:, None]
        c = blocks[None, :].to(tl.int64)
        tile = (r // 128) * (cols_p // 4) + c // 4
        rr = r % 128
        offset = tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4
        zmask = (r < rows_p) & (c < cols_p)
        tl.store(swz_ptr + offset, byte, mask=zmask)


@triton.jit(do_not_specialize=["M", "rows_p", "num_partials"])
def _quantize_tiles_kernel(
    words_ptr, data_ptr, scale_ptr, swz_ptr, gs_ptr, partials_ptr, gs_out_ptr,
    M, K, rows_p, cols_p, num_partials,
    GS_MODE: tl.constexpr, IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr, SWIZZLE: tl.constexpr,
    AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr, NAN_BYTE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    k0 = pid_k * BLOCK_K
    rows = row0 + tl.arange(0, BLOCK_M)
    if GS_MODE == 0:
        gs = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(gs_ptr)
    elif GS_MODE == 1:
        gs = tl.load(gs_ptr + rows, mask=rows < M, other=1.0)
    else:
        p = tl.arange(0, PARTIALS_BLOCK)
        partials = tl.load(partials_ptr + p, mask=p < num_partials, other=0.0)
        gs_scalar = _global_scale_from_amax(tl.max(partials, axis=0), AMAX_FLOOR_C, DIVISOR)
        gs = tl.zeros((BLOCK_M,), dtype=tl.float32) + gs_scalar
        if (pid_m == 0) & (pid_k == 0):
            tl.store(gs_out_ptr, gs_scalar)
    _quantize_tile(words_ptr, data_ptr, scale_ptr, swz_ptr, gs, row0, k0, M, K, rows_p, cols_p,
                   IN_KIND, BLOCK_M, BLOCK_K, SWIZZLE, NAN_BYTE)


@triton.jit(do_not_specialize=["M", "rows_p"])
def _quantize_rows_kernel(
    x_ptr, words_ptr, data_ptr, scale_ptr, swz_ptr, gs_out_ptr,
    M, K, k_loop, rows_p, cols_p,
    QUANTIZE: tl.constexpr, IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr,
    AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr, NAN_BYTE: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    # while loops: the interpreter cannot take range() bounds from runtime arguments
    k0 = 0
    while k0 < K:
        cols = k0 + kk
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _finite_abs(x))
        k0 += BLOCK_K
    gs = _global_scale_from_amax(tl.max(acc, axis=1), AMAX_FLOOR_C, DIVISOR)
    tl.store(gs_out_ptr + rows, gs, mask=row_ok)
    if QUANTIZE:
        k0 = 0
        while k0 < k_loop:
            _quantize_tile(words_ptr, data_ptr, scale_ptr, swz_ptr, gs, row0, k0, M, K, rows_p, cols_p,
                           IN_KIND, BLOCK_M, BLOCK_K, SWIZZLE, NAN_BYTE)
            k0 += BLOCK_K


@triton.jit
def _bf16_rne(v):
    """float32 -> bfloat16 bit pattern (int32 0..0xFFFF): round to nearest even, NaN -> 0x7FC0.

    Integer ops: the interpreter's own cast truncates; this gives torch's bits
    for every non-NaN value on GPU and interpreter alike.
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit(do_not_specialize=["M"])
def _dequantize_kernel(
    data_ptr, scale_ptr, gs_ptr, out_words_ptr, M, K,
    PER_ROW: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = e2m1(code) * (block_scale * global_scale), float32 math, rounded to out's dtype.

    Works on (BLOCK_M, BLOCK_K // 16, 8) packed bytes; the two values of a byte
    are written as one word of ``out`` (int32 for bf16 / fp16 out, OUT_KIND 0 / 1;
    int64 for fp32, OUT_KIND 2), even element in the low half.
    """
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    row_ok = rows < M
    num_blocks = K // 16
    half_k = K // 2
    pcols = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]  # (NB, 8)
    pmask = row_ok[:, None, None] & (pcols < half_k)[None, :, :]
    poffs = rows[:, None, None] * half_k + pcols[None, :, :]
    packed = tl.load(data_ptr + poffs, mask=pmask, other=0).to(tl.int32)
    smask = row_ok[:, None] & (blocks < num_blocks)[None, :]
    sbyte = tl.load(scale_ptr + rows[:, None] * num_blocks + blocks[None, :], mask=smask, other=0)
    if PER_ROW:
        gs = tl.load(gs_ptr + rows, mask=row_ok, other=1.0)
    else:
        gs = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(gs_ptr)
    scale = (e4m3_decode(sbyte) * gs[:, None])[:, :, None]  # (BM, NB, 1)
    even = e2m1_decode(packed & 15) * scale
    odd = e2m1_decode(packed >> 4) * scale
    if OUT_KIND == 0:
        word = _bf16_rne(even) | (_bf16_rne(odd) << 16)
    elif OUT_KIND == 1:
        word = (even.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | \
            (odd.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        word = (even.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | \
            (odd.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    tl.store(out_words_ptr + poffs, word, mask=pmask)


def select_config(kind: str, rows: int, interpreter: bool = False) -> tuple:
    """The tile configuration of kernel ``kind`` ("tiles", "rows", "dequant", "amax") for ``rows`` rows."""
    if interpreter:
        return INTERPRETER_CONFIGS[kind]
    for max_rows, config in QUANTIZE_CONFIGS[kind]:
        if rows <= max_rows:
            return config
    raise AssertionError("unreachable: the last bucket is unbounded")


def amax_partials_count(numel: int, interpreter: bool = False) -> int:
    """Number of amax partials (programs of the per-tensor first pass) for ``numel`` elements."""
    block, _, max_partials = select_config("amax", 0, interpreter)
    return max(1, min(triton.cdiv(numel, block), max_partials))


def launch_quantize(
    x, data, block_scale, global_scale_out, *, global_scale=None, per_row=False, partials=None,
    swizzled=None, scale_only=False, config=None, interpreter=False,
):
    """Quantize ``x`` into preallocated outputs (or only compute its global scale); no host sync.

    x: (M, K) contiguous float32/bf16/fp16, M > 0, K > 0, K % 16 == 0.
    data: (M, K // 2) uint8; block_scale: (M, K // 16) uint8 (view of the e4m3 scales).
    global_scale: None (dynamic) or a float32 tensor with 1 element (per tensor)
        or M contiguous elements (per row) holding the given scale.
    global_scale_out: dynamic modes only: float32 with 1 element (per tensor) or
        M contiguous elements (``per_row=True``) receiving the computed scale.
    partials: per-tensor dynamic mode: float32 scratch of at least
        ``amax_partials_count(M * K)`` elements (need not be zeroed).
    swizzled: None or a contiguous (rows_p, cols_p) one-byte buffer in the
        128x4 swizzled layout; every entry, padding included, is written.
    scale_only: compute only the dynamic global scale (``data``/``block_scale``
        unused); launches 1 kernel per row mode, 2 (partials, finalize) per tensor.
    config: optional (BLOCK_M, BLOCK_K, num_warps) override (benchmark tuning).
    """
    M, K = x.shape
    if swizzled is not None:
        rows_p, cols_p = swizzled.shape
        grid_rows, swz = rows_p, swizzled
    else:
        rows_p, cols_p = M, K // BLOCK_SIZE
        grid_rows, swz = M, block_scale
    k_loop = cols_p * BLOCK_SIZE
    in_kind = _IN_KINDS[x.dtype]
    words = x.view(torch.int64 if in_kind == 2 else torch.int32)  # (M, K // 2): one word per (even, odd) pair
    common = dict(AMAX_FLOOR_C=AMAX_FLOOR, DIVISOR=GLOBAL_SCALE_DIVISOR, NAN_BYTE=E4M3_NAN_BYTE)
    if global_scale is None and per_row:
        block_m, block_k, warps = config or select_config("rows", M, interpreter)
        if scale_only:
            data, block_scale, swz, grid_rows, k_loop = x, x, x, M, K
        _quantize_rows_kernel[(triton.cdiv(grid_rows, block_m),)](
            x, words, data, block_scale, swz, global_scale_out, M, K, k_loop, rows_p, cols_p,
            QUANTIZE=not scale_only, IN_KIND=in_kind, BLOCK_M=block_m, BLOCK_K=block_k, SWIZZLE=swizzled is not None,
            num_warps=warps, **common,
        )
        return
    if global_scale is None:
        num_partials = amax_partials_count(M * K, interpreter)
        amax_block, amax_warps, max_partials = select_config("amax", M, interpreter)
        _amax_partials_kernel[(num_partials,)](
            x, partials, M * K, num_partials, BLOCK=amax_block, FINALIZE=False, num_warps=amax_warps, **common)
        if scale_only:
            _amax_partials_kernel[(1,)](
                partials, global_scale_out, num_partials, 1, BLOCK=triton.next_power_of_2(max_partials),
                FINALIZE=True, num_warps=4, **common)
            return
        mode, gs_in = GS_DYNAMIC_TENSOR, global_scale_out
    else:
        num_partials, max_partials = 1, 1
        mode = GS_GIVEN_SCALAR if global_scale.numel() == 1 else GS_GIVEN_PER_ROW
        gs_in = partials = global_scale_out = global_scale
    block_m, block_k, warps = config or select_config("tiles", M, interpreter)
    grid = (triton.cdiv(grid_rows, block_m), triton.cdiv(k_loop, block_k))
    _quantize_tiles_kernel[grid](
        words, data, block_scale, swz, gs_in, partials, global_scale_out, M, K, rows_p, cols_p, num_partials,
        GS_MODE=mode, IN_KIND=in_kind, BLOCK_M=block_m, BLOCK_K=block_k, PARTIALS_BLOCK=triton.next_power_of_2(max_partials),
        SWIZZLE=swizzled is not None, num_warps=warps, **common,
    )


def launch_dequantize(data, block_scale, global_scale, out, *, config=None, interpreter=False):
    """out (M, K) float32/bf16/fp16 <- dequantized data (M, K // 2) uint8 and block_scale (M, K // 16) uint8.

    global_scale: float32 with 1 element (per tensor) or M contiguous elements (per row).
    """
    M, K = out.shape
    block_m, block_k, warps = config or select_config("dequant", M, interpreter)
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    out_kind = _IN_KINDS[out.dtype]
    out_words = out.view(torch.int64 if out_kind == 2 else torch.int32)
    _dequantize_kernel[grid](data, block_scale, global_scale, out_words, M, K, PER_ROW=global_scale.numel() != 1,
                             OUT_KIND=out_kind, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps)
