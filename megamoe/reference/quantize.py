"""Pure-PyTorch reference NVFP4 quantize / dequantize (float32 math).

These define the exact semantics every kernel must reproduce bit for bit.

Quantization of ``x (..., K)``, K a multiple of 16, all math in float32:

1. ``amax`` = max |x| over the **finite** elements (per tensor, or per row with
   ``per_row=True``), clamped below at ``AMAX_FLOOR``;
   ``global_scale = amax / 2688`` (2688 = 6 * 448, ModelOpt's ``weight_scale_2``
   convention). A caller-given global scale is used as is; it must be a
   positive, finite float32 (0-d, or broadcastable to ``shape[:-1] + (1,)``).
2. For each block of 16: ``block_amax`` = max |x| over the block;
   ``block_scale = e4m3_rne(min(block_amax / (6 * global_scale), 448))``,
   where ``6 * global_scale`` is rounded to float32 first, and e4m3_rne rounds to
   nearest, ties to even, with subnormals (values below 2**-10 give 0).
3. ``code = e2m1_rne(x / (block_scale * global_scale))`` (the product is rounded
   to float32 first): nearest E2M1 magnitude, ties to the even code, saturating
   at 6; the sign bit is the sign bit of x, also when the magnitude is 0.

Policy for special blocks:

* all-zero block, or a block whose E4M3 scale underflows to 0: scale 0 and all
  codes +0 (code 0); such a block dequantizes to zeros.
* NaN or +-Inf anywhere in a block: the block's scale byte is 0x7F (E4M3 NaN)
  and all its codes are 0, so the whole 16-element block dequantizes to NaN.
  Non-finite elements are ignored by the amax of step 1, so they do not spoil
  the rest of the tensor (or row).
* K not a multiple of 16: rejected with ValueError (pad first).

Dequantization: ``e2m1(code) * (block_scale * global_scale)`` in float32, then
cast to the requested dtype (round to nearest even).
"""
from __future__ import annotations

import torch

from ..format.constants import (
    AMAX_FLOOR,
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    GLOBAL_SCALE_DIVISOR,
)
from ..format.e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from ..format.tensor import NVFP4Tensor

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def check_quantize_input(x: torch.Tensor, name: str = "x") -> None:
    """Raise TypeError/ValueError unless ``x`` is a float tensor (..., K), K % 16 == 0."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least one dimension (..., K), got a 0-d tensor")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"{name}: last dimension K={x.shape[-1]} must be a multiple of {BLOCK_SIZE} (pad it)")


def compute_global_scale(x: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """Global scale ``max(finite amax, AMAX_FLOOR) / 2688`` as float32.

    Returns a 0-d tensor, or ``(..., 1)`` with ``per_row=True``.
    """
    check_quantize_input(x)
    xf = x.float()
    finite_abs = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), device=x.device))
    if per_row:
        amax = finite_abs.amax(dim=-1, keepdim=True) if x.shape[-1] else finite_abs.sum(-1, keepdim=True)
    else:
        amax = finite_abs.amax() if x.numel() else torch.zeros((), device=x.device)
    amax = torch.clamp(amax, min=AMAX_FLOOR)
    return (amax / GLOBAL_SCALE_DIVISOR).to(torch.float32)


def check_global_scale(global_scale, x: torch.Tensor) -> torch.Tensor:
    """Validate a caller-given global scale for ``x``; returns it 0-d when it has one element.

    Expected: a float32 tensor on x's device, 0-d or broadcastable to
    ``x.shape[:-1] + (1,)``. Raises TypeError / ValueError naming ``global_scale``.
    """
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"global_scale: expected a float32 tensor, got {type(global_scale).__name__}")
    if global_scale.dtype != torch.float32:
        raise TypeError(f"global_scale: expected float32, got {global_scale.dtype}")
    if global_scale.device != x.device:
        raise ValueError(f"global_scale: expected device {x.device} (x's), got {global_scale.device}")
    row_shape = tuple(x.shape[:-1]) + (1,)
    if global_scale.dim() == 0:
        return global_scale
    if global_scale.numel() == 1 and global_scale.dim() <= len(row_shape):
        return global_scale.reshape(())
    gs = tuple(global_scale.shape)
    if len(gs) != len(row_shape) or gs[-1] != 1 or any(g not in (1, r) for g, r in zip(gs, row_shape)):
        raise ValueError(f"global_scale: expected a 0-d tensor or a shape broadcastable to {row_shape}, got {gs}")
    return global_scale


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None, *, per_row: bool = False) -> NVFP4Tensor:
    """Reference NVFP4 quantization (see the module docstring for the exact rules).

    x: (..., K) float32/bfloat16/float16, K % 16 == 0.
    global_scale: None (computed: 0-d, or (..., 1) with ``per_row=True``) or a
        float32 tensor, 0-d or broadcastable to ``x.shape[:-1] + (1,)``.
    Returns an :class:`NVFP4Tensor` on x's device.
    """
    check_quantize_input(x)
    if global_scale is None:
        global_scale = compute_global_scale(x, per_row=per_row)
    else:
        global_scale = check_global_scale(global_scale, x)
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    xf = x.float().reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    gs = global_scale.unsqueeze(-1) if global_scale.dim() else global_scale  # (..., 1, 1) or ()

    finite = torch.isfinite(xf).all(dim=-1, keepdim=True)
    block_amax = xf.abs().amax(dim=-1, keepdim=True) if k else xf.sum(-1, keepdim=True)
    block_amax = torch.where(finite, block_amax, torch.zeros((), device=x.device))
    scale_f32 = block_amax / (gs * E2M1_MAX)
    scale_f32 = torch.clamp(scale_f32, max=E4M3_MAX)
    block_scale = scale_f32.to(torch.float8_e4m3fn)
    scale_dec = block_scale.float()

    denom = scale_dec * gs
    safe = (scale_dec > 0) & finite
    v = xf / torch.where(safe, denom, torch.ones((), device=x.device))
    codes = e2m1_encode(v)
    codes = torch.where(safe, codes, torch.zeros((), dtype=torch.uint8, device=x.device))

    scale_bytes = block_scale.view(torch.uint8)
    scale_bytes = torch.where(finite, scale_bytes, torch.full((), E4M3_NAN_BYTE, dtype=torch.uint8, device=x.device))
    data = pack_nibbles(codes.reshape(*lead, k))
    return NVFP4Tensor(
        data=data,
        block_scale=scale_bytes.reshape(*lead, k // BLOCK_SIZE).view(torch.float8_e4m3fn),
        global_scale=global_scale.to(torch.float32),
        shape=x.shape,
    )


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference NVFP4 dequantization: ``e2m1 * (block_scale * global_scale)`` in float32, cast to ``dtype``.

    Returns a (..., K) tensor of ``dtype`` on t's device.
    """
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    t = t.rows_in_order()  # the row-interleaved kernel layout (NVFP4Tensor.row_interleave): back to row-major
    lead = tuple(t.shape[:-1])
    k = t.shape[-1]
    values = e2m1_decode(unpack_nibbles(t.data)).reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    gs = t.global_scale
    gs = gs.unsqueeze(-1) if gs.dim() else gs
    scale = t.block_scale.float().unsqueeze(-1) * gs
    return (values * scale).reshape(*lead, k).to(dtype)
