"""NVFP4 format constants.

NVFP4 stores a tensor ``x (..., K)`` as

* ``data``: uint8 ``(..., K // 2)``, two E2M1 codes per byte, the **low nibble
  holding the even element** (the layout of ``torch.float4_e2m1fn_x2`` and of
  NVIDIA ModelOpt checkpoints);
* ``block_scale``: float8_e4m3fn ``(..., K // 16)``, one scale per 16
  consecutive elements along K;
* ``global_scale``: float32, per tensor (0-d) or broadcastable to
  ``shape[:-1] + (1,)`` (per row, or per expert for stacked weights).

and decodes as ``value = e2m1(code) * (block_scale * global_scale)``.

An E2M1 code is 4 bits: bit 3 is the sign, bits 0-2 index the magnitudes
``E2M1_VALUES``.
"""

#: Elements sharing one E4M3 block scale.
BLOCK_SIZE = 16

#: Magnitudes of the eight E2M1 codes 0..7 (code | 8 is the negative twin).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Largest E2M1 magnitude.
E2M1_MAX = 6.0

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0

#: Smallest positive (subnormal) float8_e4m3fn value, 2**-9.
E4M3_MIN_SUBNORMAL = 2.0**-9

#: float8_e4m3fn bit pattern used as the NaN block scale of non-finite blocks.
E4M3_NAN_BYTE = 0x7F

#: ModelOpt convention: ``global_scale = amax / (E2M1_MAX * E4M3_MAX)``.
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688.0

#: The amax used for a computed global scale is clamped below at this value so
#: that the global scale, and ``block_scale * global_scale``, stay normal
#: float32 numbers (an all-zero tensor gets ``AMAX_FLOOR / 2688``).
AMAX_FLOOR = 2.0**-100

#: E2M1 rounding thresholds on |x / (block_scale * global_scale)|: the code
#: magnitude is the number of thresholds passed. ``(t, inclusive)``: a value
#: equal to ``t`` passes when ``inclusive`` (ties go to the even code).
E2M1_THRESHOLDS = (
    (0.25, False),  # 0 | 0.5   tie -> 0   (code 0)
    (0.75, True),   # 0.5 | 1   tie -> 1   (code 2)
    (1.25, False),  # 1 | 1.5   tie -> 1   (code 2)
    (1.75, True),   # 1.5 | 2   tie -> 2   (code 4)
    (2.5, False),   # 2 | 3     tie -> 2   (code 4)
    (3.5, True),    # 3 | 4     tie -> 4   (code 6)
    (5.0, False),   # 4 | 6     tie -> 4   (code 6)
)
