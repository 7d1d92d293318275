"""Triton device functions shared by the NVFP4 kernels.

They implement the format's conversions with integer arithmetic so that the
GPU and the Triton interpreter give the same bits as the PyTorch reference
(``megamoe/reference/quantize.py``). The interpreter's own fp32 -> float8e4nv
cast truncates instead of rounding, and it decodes e4m3 0x7F as 480 instead of
NaN, so kernels that need exactness call these instead of raw casts.
"""
import triton
import triton.language as tl


@triton.jit
def e2m1_magnitude_code(a):
    """|v| (float32, >= 0) -> E2M1 magnitude code 0..7 (int32).

    Round to nearest, ties to the even code, saturating at 6. NaN gives 0.
    """
    code = (a > 0.25).to(tl.int32)
    code += (a >= 0.75).to(tl.int32)
    code += (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32)
    code += (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code


@triton.jit
def sign_bit(x):
    """Sign bit (0 or 1, int32) of float32 ``x``, -0.0 included."""
    return (x.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def e4m3_encode(s):
    """Non-negative float32 ``s`` (<= 448, not NaN) -> float8_e4m3fn byte (int32 0..126).

    Round to nearest, ties to even, with E4M3 subnormals (step 2**-9); values
    below 2**-10 (and exactly 2**-10) give 0. Same bits as torch's
    ``.to(torch.float8_e4m3fn)``.
    """
    bits = s.to(tl.int32, bitcast=True)
    biased_exp = (bits >> 23) & 0xFF
    # Normal E4M3 range (s >= 2**-6): keep 3 mantissa bits, round the 20 dropped
    # bits to nearest even; a carry moves into the exponent as it should.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: count units of 2**-9 with an exact integer shift.
    mantissa = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - biased_exp, 31)
    shift = tl.maximum(shift, 1)
    quotient = mantissa >> shift
    remainder = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.int32)
    byte = tl.where(biased_exp >= 121, normal, subnormal)
    return tl.where(biased_exp == 0, 0, byte)


@triton.jit
def e4m3_decode(byte):
    """float8_e4m3fn byte (any int type, low 8 bits used) -> float32; 0x7F/0xFF -> NaN."""
    b = byte.to(tl.int32) & 0xFF
    exponent = (b >> 3) & 0xF
    mantissa = b & 7
    sign = b >> 7
    normal_bits = (sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)
    normal = normal_bits.to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e2m1_decode(code):
    """E2M1 code (int, 0..15) -> float32 value (exact)."""
    c = code.to(tl.int32)
    magnitude = c & 7
    bits = tl.where(magnitude >= 2, (magnitude << 22) + (126 << 23), 0)
    bits = tl.where(magnitude == 1, 126 << 23, bits)
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_decode_bf16(code):
    """E2M1 code (int, 0..15) -> bfloat16 value (exact), via 16-bit patterns."""
    c = code.to(tl.int32)
    magnitude = c & 7
    bits = tl.where(magnitude >= 2, (magnitude << 6) + 0x3F00, 0)
    bits = tl.where(magnitude == 1, 0x3F00, bits)
    bits = bits | ((c & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


# ---------------------------------------------------------------------------
# Weight decode for the GEMM-family kernels (dense/grouped GEMM, GEMV, indexer):
# E2M1 bit patterns scaled by 2**-126 times a block-scale factor scale * 2**118,
# so the decoded bf16 weights carry an exact 2**-8 that the epilogues undo.
# ---------------------------------------------------------------------------


@triton.jit
def e4m3_scale_factor_2p118(s):
    """E4M3 block-scale bytes (int32) -> float32 ``scale * 2**118`` (exact); 0x7F / 0xFF -> NaN.

    The factor 2**118 pairs with the E2M1 bit trick of :func:`decode_e2m1_pairs_sm90`
    (values carry 2**-126); the product is ``e2m1 * scale * 2**-8``, and the
    epilogue multiplies by ``global_scale * 2**8``. Normal E4M3 (exponent field
    e > 0) maps to the bf16/fp32 exponent ``e + 238`` by integer arithmetic;
    subnormals (m * 2**-9) are m * 2**109.
    """
    magnitude_bits = (((s & 0x7F) << 4) + (238 << 7)) << 16
    normal = (magnitude_bits | ((s & 0x80) << 24)).to(tl.float32, bitcast=True)
    subnormal = (s & 7).to(tl.float32) * 6.490371073168535e32  # 2**109
    subnormal = tl.where((s & 0x80) != 0, -subnormal, subnormal)
    factor = tl.where((s & 0x78) == 0, subnormal, normal)
    return tl.where((s & 0x7F) == 0x7F, float("nan"), factor)


@triton.jit
def decode_e2m1_pairs_portable(packed, factor):
    """Portable decode (the Triton interpreter's path), same bits as :func:`decode_e2m1_pairs_sm90`.

    packed: (BLOCK_N, BLOCK_K//2) uint8; factor: (BLOCK_N, BLOCK_K//2) float32
    (``scale * 2**118`` per byte). Returns (even, odd) (BLOCK_N, BLOCK_K//2) bf16
    = ``e2m1 * scale * 2**-8`` of the low / high nibbles. The nibble s|eem placed as
    ``s << 15 | eem << 6`` is the bf16 number ``e2m1 * 2**-126`` (eem = 001 is a
    subnormal); here it is built as an fp32 bit pattern (the interpreter flushes
    bf16 subnormals and has no bf16 arithmetic), the product is exact.
    """
    p = packed.to(tl.int32)
    lo = ((p & 7) << 22) | ((p & 8) << 28)
    hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
    even = (lo.to(tl.float32, bitcast=True) * factor).to(tl.bfloat16)
    odd = (hi.to(tl.float32, bitcast=True) * factor).to(tl.bfloat16)
    return even, odd


@triton.jit
def decode_e2m1_pairs_sm90(packed, factor):
    """GPU decode: 4 packed bytes -> 4 even + 4 odd bf16 weights in ~3 instructions per weight.

    Same contract as :func:`decode_e2m1_pairs_portable`. Per 4 bytes b0..b3 (one
    32-bit register): ``prmt`` spreads (b0, b1) and (b2, b3) into the two 16-bit
    halves, shifts + ``lop3`` place the E2M1 magnitude bits at bf16 bits 6-8 and
    the sign at bit 15 (``e2m1 * 2**-126`` in each half: a bf16x2 pair), and one
    ``mul.rn.bf16x2`` by the bf16 factor ``scale * 2**118`` gives the exact
    ``e2m1 * scale * 2**-8`` (bf16 arithmetic keeps subnormal inputs on sm_90).
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, a, b, s0, s1, z;
        mov.b32 z, 0;
        cvt.rn.bf16x2.f32 s0, $6, $5;
        cvt.rn.bf16x2.f32 s1, $8, $7;
        prmt.b32 t0, $4, z, 0x7170;
        prmt.b32 t1, $4, z, 0x7372;
        shl.b32 a, t0, 6;
        and.b32 b, t0, 0x00080008;
        shl.b32 b, b, 12;
        lop3.b32 a, a, 0x01C001C0, b, 0xEA;
        mul.rn.bf16x2 $0, a, s0;
        shl.b32 a, t1, 6;
        and.b32 b, t1, 0x00080008;
        shl.b32 b, b, 12;
        lop3.b32 a, a, 0x01C001C0, b, 0xEA;
        mul.rn.bf16x2 $1, a, s1;
        shl.b32 a, t0, 2;
        and.b32 b, t0, 0x00800080;
        shl.b32 b, b, 8;
        lop3.b32 a, a, 0x01C001C0, b, 0xEA;
        mul.rn.bf16x2 $2, a, s0;
        shl.b32 a, t1, 2;
        and.b32 b, t1, 0x00800080;
        shl.b32 b, b, 8;
        lop3.b32 a, a, 0x01C001C0, b, 0xEA;
        mul.rn.bf16x2 $3, a, s1;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, factor],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def round_to_bf16(v, INTERPRET: tl.constexpr):
    """float32 -> bfloat16, round to nearest even (the interpreter's own cast truncates)."""
    if INTERPRET:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))
    return v.to(tl.bfloat16)
