"""Fused, sync-free NVFP4 quantize / dequantize Triton kernels.

Semantics are exactly those of ``megamoe/reference/quantize.py`` (bit for bit:
packed bytes, block-scale bytes and global-scale bits); the products are rounded
in the reference's order (``6 * global_scale``, ``block_scale * global_scale``).
The per-element arithmetic of the quantize kernels is cheaper than the
reference's but gives the same bits, with the argument in each helper's
docstring: ``_block_divisor`` + ``_e2m1_code_bits`` (x / d through a correctly
rounded per-block reciprocal and one exact fma residue correction, then the E2M1
code as the float32 bit pattern of two fmas and two mins), ``_pack_codes``,
``_e4m3_round_sat`` (block scale), ``_bf16x2_block_amax`` / ``_bf16x2_scale``
(bf16 pairs). The block-scale division ``amax / (6 * global_scale)`` is still
``tl.div_rn``. GPU-only pieces are inline PTX; each has an interpreter twin
(``INTERPRET`` constexpr) giving the same bits, so the CPU tests run the same
algorithm (``tests/kernels/test_quantize_kernels.py`` also executes the integer
PTX with a small emulator).

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
from .nvfp4_jit import e2m1_decode, e4m3_decode

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
def _split_pairs(w, IN_KIND: tl.constexpr):
    """(even, odd) elements as float32 from one word per pair (exact conversions).

    w: x reinterpreted as int32 pairs (IN_KIND 0: bf16, 1: fp16) or int64 pairs
    (IN_KIND 2: fp32); the even element sits in the low half (little endian). One
    wide load per pair keeps the accesses vectorised without any register shuffles
    to separate even from odd elements.
    """
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
def _fma_rn(a, b, c, INTERPRET: tl.constexpr):
    """float32 ``a * b + c`` rounded once (round to nearest even), as ``fma.rn.f32`` on the GPU.

    The interpreter's own ``tl.fma`` rounds the product first; its twin here is exact:
    the product is exact in float64, TwoSum gives the exact error of the float64 sum,
    and the one case where rounding that sum to float32 rounds twice (the float64 sum
    is exactly a float32 midpoint but the exact sum is not) is resolved by the error's sign.
    """
    if INTERPRET:
        p = a.to(tl.float64) * b.to(tl.float64)
        cc = c.to(tl.float64)
        s = p + cc
        bb = s - p
        err = (p - (s - bb)) + (cc - bb)  # p + cc == s + err exactly
        r = s.to(tl.float32)
        diff = s - r.to(tl.float64)  # exact
        other = r.to(tl.float64) + 2.0 * diff  # the other float32 neighbour if s is a float32 midpoint
        is_mid = (diff != 0.0) & (other.to(tl.float32).to(tl.float64) == other)
        toward = (err != 0.0) & ((err > 0.0) == (diff > 0.0))
        return tl.where(is_mid & toward, other.to(tl.float32), r)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _min_nan_to_b(a, b, INTERPRET: tl.constexpr):
    """min(a, b) for float32, returning b when a is NaN (b is never NaN): PTX ``min.f32``."""
    if INTERPRET:  # numpy's minimum propagates NaN
        return tl.where(a != a, b, tl.minimum(a, b))
    else:
        return tl.minimum(a, b)


@triton.jit
def _max_nan_to_a(a, b, INTERPRET: tl.constexpr):
    """max(a, b) for float32, returning a when b is NaN (a is never NaN): PTX ``max.f32``."""
    if INTERPRET:
        return tl.where(b != b, a, tl.maximum(a, b))
    else:
        return tl.maximum(a, b)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_round(v):
    """float32 v in [0, 448] -> (E4M3 value as float32, its float8_e4m3fn byte as int32).

    Round to nearest even like ``torch.Tensor.to(torch.float8_e4m3fn)``. Below 2**-6
    the E4M3 grid is fixed point with step 2**-9, so adding 2**14 (whose ulp is 2**-9)
    rounds exactly there, and the integer k of k * 2**-9 is the byte (k = 8 is the byte
    of 2**-6, also right). From 2**-6 up the value keeps 4 significant bits: the 20
    dropped mantissa bits are rounded to nearest even with an integer add (a carry moves
    into the exponent), and the byte is exponent and top mantissa bits less the bias.
    """
    t = v + 16384.0
    sub_val = t - 16384.0
    sub_byte = t.to(tl.int32, bitcast=True) - 0x46800000
    b = v.to(tl.int32, bitcast=True)
    rb = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
    norm_val = rb.to(tl.float32, bitcast=True)
    norm_byte = (rb >> 20) - (120 << 3)
    is_sub = v < 0.015625
    return tl.where(is_sub, sub_val, norm_val), tl.where(is_sub, sub_byte, norm_byte)


# float32 bit pattern of the E2M1 code c in ``_e2m1_code_bits``: CODE_BITS_0 + c (c = 0..7)
CODE_BITS_0 = tl.constexpr(0x4B7FFFFC)  # 2**24 - 4
# The four codes of one 32-bit word of packed pairs, summed as raw bit patterns, carry this constant.
_PACK_GARBAGE = (CODE_BITS_0.value * 17 * (1 + (1 << 8) + (1 << 16) + (1 << 24))) % (1 << 32)
assert (-_PACK_GARBAGE) % (1 << 32) == 0xC0C44444  # the constant added in _pack_codes' asm


@triton.jit
def _e4m3_round_sat(v, INTERPRET: tl.constexpr):
    """``_e4m3_round(min(v, 448))`` for float32 v >= 0 (not NaN): (E4M3 value, byte).

    GPU: ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even with E4M3 subnormals and
    saturates above 448 (Inf included) to 448, exactly the reference's clamp-then-cast;
    ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16`` decode the byte exactly.
    """
    if INTERPRET:
        return _e4m3_round(tl.minimum(v, 448.0))
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 e, h0, h1;
            .reg .b32 hh;
            cvt.rn.satfinite.e4m3x2.f32 e, $2, $2;
            cvt.rn.f16x2.e4m3x2 hh, e;
            mov.b32 {h0, h1}, hh;
            cvt.f32.f16 $0, h0;
            cvt.u32.u16 $1, e;
            and.b32 $1, $1, 255;
            }
            """,
            constraints="=r,=r,r",
            args=[v],
            dtype=(tl.float32, tl.int32),
            is_pure=True,
            pack=1,
        )


@triton.jit
def _rcp_rn(x, INTERPRET: tl.constexpr):
    """RN(1 / x) for normal float32 x with 2**-120 < |x| < 2**120 (float32 ``rcp.rn``).

    GPU: the fast path of ``rcp.rn.f32`` as ptxas emits it for sm_90 (approximate
    reciprocal and one fma Newton step, correctly rounded in that exponent range)
    without its range check and slow-path branch.
    """
    if INTERPRET:
        return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .f32 y, e;
            rcp.approx.ftz.f32 y, $1;
            fma.rn.f32 e, $1, y, 0fBF800000;
            neg.f32 e, e;
            fma.rn.f32 $0, y, e, y;
            }
            """,
            constraints="=r,r",
            args=[x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def _block_divisor(d, INTERPRET: tl.constexpr):
    """Per-block constants of ``_e2m1_code_bits`` for the divisor d (float32, 0 <= d < 2**127): (s, dp, r).

    s = 2**(127 - biased exponent of d), a normal power of two (d is at most ~amax / 3),
    and dp = d * s (exact): in [1, 2) for normal d and in [2**-23, 1) for subnormal d
    (s = 2**127), so the reciprocal, the quotients and residues of the elements that
    matter stay far from under/overflow; r = RN(1 / dp), the correctly rounded reciprocal.

    d == 0 only happens with a given global scale below ~2**-141 (subnormal) and a
    nonzero block: the reference then divides by zero (+-Inf, code 7 with the sign, and
    0 / 0 = NaN whose sign bit is platform dependent); here every element of such a
    block gets code 7 with its sign, as with the previous kernel on the GPU.
    """
    s = (0x7F000000 - (d.to(tl.int32, bitcast=True) & 0x7F800000)).to(tl.float32, bitcast=True)
    dp = d * s
    return s, dp, _rcp_rn(dp, INTERPRET)


@triton.jit
def _e2m1_code_bits(xs, r, ndp, sat, INTERPRET: tl.constexpr):
    """E2M1 magnitude code c (0..7) of x / d, returned as the int32 ``CODE_BITS_0 + c``.

    Per 16-element block (see ``_quantize_tile`` and ``_block_divisor``): xs = x * s and
    dp = d * s for a power of two s (dp in [2**-23, 2)), ndp = -dp, r = RN(1 / dp);
    sat = 2**24 + 6 (code 7), or 2**24 - 4 (code 0) for blocks whose codes are all 0.

    1. Quotient (y = x / d = xs / dp; u = ulp(y)). xs is exact where it matters: the
       elements with |y| in [1/8, 8] have |xs| in [dp/8, 8*dp], far from under/overflow
       (smaller ones may underflow and stay tiny, larger ones may overflow to Inf).
       q0 = RN(xs * r): |xs*r - y| = |y| * |dp*r - 1| < |y| * 2**-24 = (m/2) u, m the
       significand of y in [1, 2). e = RN(xs - q0*dp) (one fma) and q1 = RN(q0 + e*r)
       (one fma): q0 + e*r is y + (y - q0)*O(2**-23), so q1 == RN(y) unless y lies within
       ~2**-22 u of a float32 midpoint, and then q1 is the other neighbour of that
       midpoint. The code depends on RN(y) only through the seven midpoints next to the
       thresholds (t + u/2 for the strict 0.25, 1.25, 2.5, 5; t - u/2 for the inclusive
       0.75, 1.75, 3.5: the two neighbours of any other midpoint have the same code).
       There m <= 1.75, so |xs*r - y| < 0.875 u puts q0 on one of the midpoint's two
       neighbours (q0 is faithful), the residue xs - q0*dp is then exact (a multiple of
       ulp(q0) * ulp(dp) >= 2**-73, fewer than 2**24 of them) and q1 == RN(y) by
       Markstein's theorem (r correctly rounded, q0 faithful, exact residue). A quotient
       is never exactly a float32 midpoint, so no tie of that rounding occurs.
    2. Code: for q = |RN(x / d)|, code(q) = RNE(min(2q, q + 2, q/2 + 4, 7)) (each
       affine piece maps the E2M1 values of its range to consecutive integers, RNE is
       monotone, ties go to the even code). RN(2q + 2**24 - 4) is 2**24 - 4 + RNE(2q)
       below 2**24 (ulp 1) and 2**24 + 2*RNE(q - 2) above (ulp 2): as float32 bits that
       is CODE_BITS_0 + RNE(min(2q, q + 2)) in one fma. Likewise RN(q + 2**24) has bits
       CODE_BITS_0 + RNE(q/2 + 4), and bit patterns of positive floats order like their
       values, so one fma, one add and two mins give the code. NaN (an Inf element or
       quotient: |x / d| is huge) gives ``sat`` through min.f32.
    """
    q0 = xs * r
    e = _fma_rn(q0, ndp, xs, INTERPRET)  # xs - q0 * dp
    q1 = _fma_rn(e, r, q0, INTERPRET)
    qa = tl.abs(q1)
    if INTERPRET:  # 2 * qa is exact, so one rounding as in fma
        v = tl.minimum(qa * 2.0 + 16777212.0, qa + 16777216.0)
    else:
        v = tl.minimum(tl.fma(qa, tl.full(qa.shape, 2.0, tl.float32), tl.full(qa.shape, 16777212.0, tl.float32)),
                       qa + 16777216.0)
    return _min_nan_to_b(v, sat, INTERPRET).to(tl.int32, bitcast=True)


@triton.jit
def _bf16x2_absmax(a, b):
    """Per 16-bit half: bf16 max(|a|, |b|) (sign bits: xor, ignored), NaN if either is NaN."""
    return tl.inline_asm_elementwise(
        asm="max.NaN.xorsign.abs.bf16x2 $0, $1, $2;",
        constraints="=r,r,r",
        args=[a, b],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _bf16x2_block_amax(w):
    """max |x| (float32) over the 16 bf16 of the 8 pair words along axis 2; NaN if any is NaN, Inf if any is +-Inf."""
    m = tl.reduce(w, 2, _bf16x2_absmax)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t;
        prmt.b32 t, $1, $1, 0x1032;
        max.NaN.xorsign.abs.bf16x2 t, $1, t;
        and.b32 $0, t, 0x7FFF0000;
        }
        """,
        constraints="=r,r",
        args=[m],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _bf16x2_scale(w, s, INTERPRET: tl.constexpr):
    """Both bf16 halves of the pair words w times the power of two s (float32), rounded to bf16: (even, odd) float32.

    GPU: one ``mul.rn.bf16x2`` per word (exact unless the product leaves the normal
    range: it then rounds to a bf16 subnormal / zero, or overflows to Inf). The twin
    rounds the exact product the same way (8 significant bits fit bf16; below 2**-126
    the grid is 2**-133, rounded to nearest even with a float64 magic constant).
    """
    if INTERPRET:
        even, odd = _split_pairs(w, 0)
        return _bf16_round_product(even, s), _bf16_round_product(odd, s)
    else:
        sb = s.to(tl.int32, bitcast=True) & -65536
        s2 = sb | ((sb >> 16) & 0xFFFF)
        ws = tl.inline_asm_elementwise(
            asm="mul.rn.bf16x2 $0, $1, $2;",
            constraints="=r,r,r",
            args=[w, s2],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
        return _split_pairs(ws, 0)


@triton.jit
def _bf16_round_product(x, s):
    """RN_bf16(x * s) as float32 for a bf16 value x and a power of two s (interpreter twin of ``mul.rn.bf16x2``)."""
    p = x.to(tl.float64) * s.to(tl.float64)  # exact, at most 8 significant bits
    a = tl.abs(p)
    magic = 4.1359030627651384e-25  # 2**-81: its float64 ulp is 2**-133, bf16's subnormal step
    sub = (a + magic) - magic
    a = tl.where(a < 1.1754943508222875e-38, sub, a)  # below 2**-126
    return tl.where(p < 0, -a, a).to(tl.float32)


@triton.jit
def _pack_codes(ce, co, w, smask, INTERPRET: tl.constexpr):
    """Packed bytes ``(ce - CODE_BITS_0) | sign_e << 3 | ((co - CODE_BITS_0) | sign_o << 3) << 4`` (uint8).

    ce, co: code bit patterns of the even / odd element of each pair; w: int32 word
    whose bits 15 and 31 are the pair's signs; smask: 0x88888888 where the block is
    quantized, 0 where its codes are all +0. On the GPU four pairs (one 32-bit
    register of output) take 14 instructions: the code bit patterns are summed with
    shifts (the constant they carry subtracted once), and the eight signs are
    gathered with sign-replicating byte permutes.
    """
    if INTERPRET:
        signs = ((w >> 12) & 8) | ((w >> 24) & 0x80)
        byte = (ce - CODE_BITS_0) + ((co - CODE_BITS_0) << 4) + (signs & smask)
        return byte.to(tl.uint8)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 acc, t0, t1, e, o, s, sel;
            mad.lo.u32 acc, $5, 16, $1;
            mad.lo.u32 acc, $2, 256, acc;
            mad.lo.u32 acc, $6, 4096, acc;
            mad.lo.u32 acc, $3, 65536, acc;
            mad.lo.u32 acc, $7, 1048576, acc;
            mad.lo.u32 acc, $4, 16777216, acc;
            mad.lo.u32 acc, $8, 268435456, acc;
            prmt.b32 t0, $9, $10, 0xFBD9;
            prmt.b32 t1, $11, $12, 0xFBD9;
            prmt.b32 e, t0, t1, 0x5410;
            prmt.b32 o, t0, t1, 0x7632;
            mov.b32 sel, 0x0F0F0F0F;
            lop3.b32 s, e, o, sel, 0xE4;
            and.b32 s, s, $13;
            add.u32 acc, acc, s;
            add.u32 $0, acc, 0xC0C44444;
            }
            """,
            constraints="=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            args=[ce, co, w, smask],
            dtype=tl.uint8,
            is_pure=True,
            pack=4,
        )


@triton.jit
def _quantize_tile(
    words_ptr, data_ptr, scale_ptr, swz_ptr, gs, row0, k0, M, K, rows_p, cols_p,
    IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr,
    NAN_BYTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Quantize the (BLOCK_M, BLOCK_K) tile at (row0, k0); ``gs``: (BLOCK_M,) float32.

    Works on (BLOCK_K // 16, BLOCK_M, 8) pairs: axis 0 = 16-element block, axis 1 =
    row, axis 2 = pair within the block (one thread holds a whole block, and
    neighbouring threads hold neighbouring blocks of a row, which is also the layout
    of the block-scale store, so no shared-memory shuffle); the packed byte of a pair
    is ``code(even) | code(odd) << 4``.

    Per block: amax (NaN-propagating), scale_f32 = amax / RN(6 * gs) (div_rn), its
    E4M3 rounding (saturating at 448), d = RN(scale * gs) exactly as the reference;
    all-zero / underflowing blocks (scale 0) and non-finite blocks get codes +0 via the
    per-block ``sat`` / ``smask`` constants, non-finite blocks the NaN scale byte.
    Per element: scale by s, three-instruction quotient, four-instruction code (see
    ``_e2m1_code_bits``), packing with the sign bits (``_pack_codes``).
    """
    NB: tl.constexpr = BLOCK_K // 16
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    blocks = (k0 >> 4) + tl.arange(0, NB)  # k0 >= 0
    half_k = K >> 1  # K > 0
    num_blocks = K >> 4
    pcols = blocks[:, None, None] * 8 + tl.arange(0, 8)[None, None, :]  # (NB, 1, 8) pair index along the row
    row_ok = (row0.to(tl.int32) + tl.arange(0, BLOCK_M)) < M  # row indices fit int32 (M does)
    blk_ok = blocks < num_blocks
    pmask = row_ok[None, :, None] & blk_ok[:, None, None]
    poffs = rows[None, :, None] * half_k + pcols
    w = tl.load(words_ptr + poffs, mask=pmask, other=0)
    # block amax; NaN or +-Inf anywhere makes it NaN or Inf
    if (IN_KIND == 0) and (not INTERPRET):
        amax = _bf16x2_block_amax(w)  # (NB, BM)
    else:
        even, odd = _split_pairs(w, IN_KIND)
        amax = tl.reduce(_max_propagate_nan(tl.abs(even), tl.abs(odd)), 2, _max_propagate_nan)
    finite = amax < float("inf")
    gs2 = gs[None, :]
    scale_dec, byte = _e4m3_round_sat(tl.div_rn(amax, gs2 * 6.0), INTERPRET)
    safe = (scale_dec > 0) & finite
    d = scale_dec * gs2  # block_scale * global_scale, rounded as in the reference
    s, dp, r = _block_divisor(d, INTERPRET)
    sat = tl.where(safe, 16777222.0, 16777212.0)
    smask = tl.where(safe, -2004318072, 0)  # 0x88888888: keep the sign bits
    s3 = s[:, :, None]
    if IN_KIND == 0:
        even_s, odd_s = _bf16x2_scale(w, s3, INTERPRET)
    else:
        even_s = even * s3
        odd_s = odd * s3
    r3 = r[:, :, None]
    ndp3 = -dp[:, :, None]
    sat3 = sat[:, :, None]
    ce = _e2m1_code_bits(even_s, r3, ndp3, sat3, INTERPRET)
    co = _e2m1_code_bits(odd_s, r3, ndp3, sat3, INTERPRET)
    if IN_KIND == 2:  # a bf16-like word with the two signs at bits 15 and 31
        sw = ((w & 0xFFFFFFFF) >> 16) | ((w >> 32) & -65536)
        sw = sw.to(tl.int32)
    else:
        sw = w
    packed = _pack_codes(ce, co, sw, tl.broadcast_to(smask[:, :, None], sw.shape), INTERPRET)
    tl.store(data_ptr + poffs, packed, mask=pmask)

    byte = tl.where(finite, byte, NAN_BYTE).to(tl.uint8)  # (NB, BM)
    store_ok = row_ok[None, :] & blk_ok[:, None]
    tl.store(scale_ptr + rows[None, :] * num_blocks + blocks[:, None], byte, mask=store_ok)
    if SWIZZLE:
        r = rows[None, :]
        c = blocks[:, None].to(tl.int64)
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
    AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr, NAN_BYTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = pid_m.to(tl.int64) * BLOCK_M
    k0 = pid_k * BLOCK_K
    rows = row0 + tl.arange(0, BLOCK_M)
    if GS_MODE == 0:
        gs = tl.broadcast_to(tl.load(gs_ptr), (BLOCK_M,))
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
                   IN_KIND, BLOCK_M, BLOCK_K, SWIZZLE, NAN_BYTE, INTERPRET)


@triton.jit
def _finite_absmax_16x2(acc, w, IN_KIND: tl.constexpr):
    """Running per-half maximum of the finite |x| of bf16 (IN_KIND 0) / fp16 (1) pair words, as biased int16.

    |x| bits plus the bias (0x80 bf16, 0x400 fp16) keep finite values in [bias, 0x7FFF]
    and push Inf / NaN (|x| bits >= 0x7F80 / 0x7C00) to 0x8000 and up, negative as
    int16, so a signed 16x2 maximum (from acc = 0) skips them. GPU only (inline PTX).
    """
    if IN_KIND == 0:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            and.b32 t, $2, 0x7FFF7FFF;
            add.u32 t, t, 0x00800080;
            max.s16x2 $0, $1, t;
            }
            """,
            constraints="=r,r,r", args=[acc, w], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            and.b32 t, $2, 0x7FFF7FFF;
            add.u32 t, t, 0x04000400;
            max.s16x2 $0, $1, t;
            }
            """,
            constraints="=r,r,r", args=[acc, w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _finite_absmax_16x2_value(acc, IN_KIND: tl.constexpr):
    """float32 max finite |x| from a ``_finite_absmax_16x2`` accumulator (0 when nothing finite was seen)."""
    if IN_KIND == 0:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            prmt.b32 t, $1, $1, 0x1032;
            max.s16x2 t, $1, t;
            and.b32 t, t, 0xFFFF;
            sub.s32 t, t, 0x80;
            max.s32 t, t, 0;
            shl.b32 $0, t, 16;
            }
            """,
            constraints="=r,r", args=[acc], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            .reg .b16 h;
            prmt.b32 t, $1, $1, 0x1032;
            max.s16x2 t, $1, t;
            and.b32 t, t, 0xFFFF;
            sub.s32 t, t, 0x400;
            max.s32 t, t, 0;
            cvt.u16.u32 h, t;
            cvt.f32.f16 $0, h;
            }
            """,
            constraints="=r,r", args=[acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit(do_not_specialize=["M", "rows_p"])
def _quantize_rows_kernel(
    x_ptr, words_ptr, data_ptr, scale_ptr, swz_ptr, gs_out_ptr,
    M, K, k_loop, rows_p, cols_p,
    QUANTIZE: tl.constexpr, IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr,
    AMAX_FLOOR_C: tl.constexpr, DIVISOR: tl.constexpr, NAN_BYTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # while loops: the interpreter cannot take range() bounds from runtime arguments
    if (IN_KIND != 2) and (not INTERPRET):  # 16-bit elements: two per word, integer 16x2 maxima
        half_k = K >> 1
        kk = tl.arange(0, BLOCK_K // 2)
        wacc = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.int32)
        k0 = 0
        while k0 < K:
            cols = (k0 >> 1) + kk
            mask = row_ok[:, None] & (cols < half_k)[None, :]
            w = tl.load(words_ptr + rows[:, None] * half_k + cols[None, :], mask=mask, other=0)
            wacc = _finite_absmax_16x2(wacc, w, IN_KIND)
            k0 += BLOCK_K
        row_amax = tl.max(_finite_absmax_16x2_value(wacc, IN_KIND), axis=1)
    else:
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        k0 = 0
        while k0 < K:
            cols = k0 + kk
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # |x| + x * 0 is |x| for finite x and NaN for +-Inf / NaN, which max.f32 ignores
            acc = _max_nan_to_a(acc, _fma_rn(x, tl.zeros_like(x), tl.abs(x), INTERPRET), INTERPRET)
            k0 += BLOCK_K
        row_amax = tl.max(acc, axis=1)
    gs = _global_scale_from_amax(row_amax, AMAX_FLOOR_C, DIVISOR)
    tl.store(gs_out_ptr + rows, gs, mask=row_ok)
    if QUANTIZE:
        k0 = 0
        while k0 < k_loop:
            _quantize_tile(words_ptr, data_ptr, scale_ptr, swz_ptr, gs, row0, k0, M, K, rows_p, cols_p,
                           IN_KIND, BLOCK_M, BLOCK_K, SWIZZLE, NAN_BYTE, INTERPRET)
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


@triton.jit
def _e2m1_unscaled_bf16_bits(code, scale_2p14):
    """E2M1 code (int32, low 4 bits) times an E4M3 block scale -> bf16 bit pattern (int32 0..0xFFFF), exact.

    The code's bits placed as a float16 (``(c & 7) << 9``, sign ``(c & 8) << 12``) are e2m1 * 2**-14 exactly (code 1,
    0.5, is the float16 subnormal 2**-15); converted to float32 (exact) and multiplied by ``scale * 2**14`` (float32,
    exact), the product e2m1 * scale has at most 6 significant bits and lies in [2**-10, 2688], so its bf16 pattern is
    the float32's high half with no rounding. A NaN scale gives 0x7FC0, as :func:`_bf16_rne`.
    """
    h = ((code & 7) << 9) | ((code & 8) << 12)
    v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale_2p14
    return tl.where(v != v, 0x7FC0, (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF)


@triton.jit(do_not_specialize=["M"])
def _dequantize_kernel(
    data_ptr, scale_ptr, gs_ptr, out_words_ptr, M, K,
    PER_ROW: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    UNSCALED: tl.constexpr = False,
):
    """out = e2m1(code) * (block_scale * global_scale), float32 math, rounded to out's dtype.

    Works on (BLOCK_M, BLOCK_K // 16, 8) packed bytes; the two values of a byte
    are written as one word of ``out`` (int32 for bf16 / fp16 out, OUT_KIND 0 / 1;
    int64 for fp32, OUT_KIND 2), even element in the low half.
    UNSCALED (bf16 out only): out = e2m1(code) * block_scale, without the global scale (``gs_ptr`` unread), exact in
    bf16 (:func:`_e2m1_unscaled_bf16_bits`, about half the integer work of the general path).
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
    if UNSCALED:
        scale_2p14 = (e4m3_decode(sbyte) * 16384.0)[:, :, None]  # (BM, NB, 1), exact
        word = _e2m1_unscaled_bf16_bits(packed & 15, scale_2p14) | \
            (_e2m1_unscaled_bf16_bits(packed >> 4, scale_2p14) << 16)
        tl.store(out_words_ptr + poffs, word, mask=pmask)
        return
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
    kernel_flags = dict(INTERPRET=bool(interpreter))
    if global_scale is None and per_row:
        block_m, block_k, warps = config or select_config("rows", M, interpreter)
        if scale_only:
            data, block_scale, swz, grid_rows, k_loop = x, x, x, M, K
        _quantize_rows_kernel[(triton.cdiv(grid_rows, block_m),)](
            x, words, data, block_scale, swz, global_scale_out, M, K, k_loop, rows_p, cols_p,
            QUANTIZE=not scale_only, IN_KIND=in_kind, BLOCK_M=block_m, BLOCK_K=block_k, SWIZZLE=swizzled is not None,
            num_warps=warps, **common, **kernel_flags,
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
        GS_MODE=mode, IN_KIND=in_kind, BLOCK_M=block_m, BLOCK_K=block_k,
        PARTIALS_BLOCK=triton.next_power_of_2(max_partials),
        SWIZZLE=swizzled is not None, num_warps=warps, **common, **kernel_flags,
    )


def launch_dequantize(data, block_scale, global_scale, out, *, config=None, interpreter=False, unscaled=False):
    """out (M, K) float32/bf16/fp16 <- dequantized data (M, K // 2) uint8 and block_scale (M, K // 16) uint8.

    global_scale: float32 with 1 element (per tensor) or M contiguous elements (per row).
    unscaled: bf16 out only; e2m1 * block_scale without the global scale (not read), exact (the kernel's UNSCALED
    path; its tile by K: :func:`unscaled_dequant_config`).
    """
    M, K = out.shape
    out_kind = _IN_KINDS[out.dtype]
    if unscaled:
        if out_kind != 0:
            raise ValueError(f"out: the unscaled dequantize writes bf16, got {out.dtype}")
        config = config or (INTERPRETER_CONFIGS["dequant"] if interpreter else unscaled_dequant_config(K))
    block_m, block_k, warps = config or select_config("dequant", M, interpreter)
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    out_words = out.view(torch.int64 if out_kind == 2 else torch.int32)
    _dequantize_kernel[grid](data, block_scale, global_scale, out_words, M, K, PER_ROW=global_scale.numel() != 1,
                             OUT_KIND=out_kind, BLOCK_M=block_m, BLOCK_K=block_k, UNSCALED=unscaled,
                             num_warps=warps)


def unscaled_dequant_config(k: int) -> tuple:
    """(BLOCK_M, BLOCK_K, warps) of the unscaled bf16 dequantize for rows of ``k`` elements: BLOCK_K 1024 where it
    divides K, else 512 (K = 1536: no half-empty second tile)."""
    return (4, 1024, 4) if k % 1024 == 0 else (8, 512, 4)
