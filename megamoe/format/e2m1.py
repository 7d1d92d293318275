"""E2M1 encoding, decoding and nibble packing in pure PyTorch (float32 math)."""
from __future__ import annotations

import torch

from .constants import E2M1_THRESHOLDS


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 ``v`` to the nearest E2M1 code, ties to the even code.

    Magnitudes above 6 saturate to 6 (code 7). The sign bit (bit 3) is the sign
    bit of ``v``, also when the magnitude rounds to zero (-0.0 and small negative
    values give code 8). NaN gives magnitude code 0 with its sign bit.

    v: any shape, float32.  Returns uint8 codes 0..15 of the same shape.
    """
    a = v.abs()
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, inclusive in E2M1_THRESHOLDS:
        passed = (a >= threshold) if inclusive else (a > threshold)
        mag += passed.to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, any shape) -> float32 values (exact).

    Computed from the code bits (no host-side table: sync-free and CUDA-graph capturable): exponent field
    ``e = (code >> 1) & 3``, mantissa bit ``m``; ``e == 0``: ``m / 2``, else ``(1 + m / 2) * 2**(e - 1)``.
    """
    mag = codes & 7
    e = (mag >> 1).float()
    m = (mag & 1).float()
    value = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    return torch.where((codes & 8) != 0, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 codes -> (..., K // 2) bytes; element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even, got {codes.shape[-1]}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """(..., K // 2) packed bytes -> (..., K) uint8 codes (low nibble first)."""
    low = data & 0xF
    high = data >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
