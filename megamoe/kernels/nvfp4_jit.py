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
