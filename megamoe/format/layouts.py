"""Block-scale layouts.

The plain layout of ``block_scale`` is row-major ``(rows, K // 16)``. Tensor
cores that read scales directly (Blackwell ``tcgen05`` block-scaled MMA, cuBLAS
and CUTLASS NVFP4 GEMMs) want the *128x4 swizzled* layout: rows are padded to a
multiple of 128 and scale columns to a multiple of 4; each 128x4 tile is stored
as 512 contiguous bytes, tile ``(i, j)`` (row tile i, column tile j) at offset
``(i * (cols_padded // 4) + j) * 512``, and inside a tile the scale of row
``r`` (0..127) and column ``c`` (0..3) sits at ``(r % 32) * 16 + (r // 32) * 4 + c``.

Triton's block-scaled matmul reads the same bytes as a 5-D tensor
``[1, rows // 128, cols // 4, 2, 256]``: a pure reshape of the swizzled layout.
Padding entries are zero.
"""
from __future__ import annotations

import torch


def _ceil_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def swizzled_128x4_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded ``(rows, cols)`` of the 128x4 swizzled layout for a plain (rows, cols) scale matrix."""
    return _ceil_to(rows, 128), _ceil_to(cols, 4)


def swizzled_128x4_offset(row: torch.Tensor, col: torch.Tensor, cols_padded: int) -> torch.Tensor:
    """Flat byte offset of plain scale (row, col) inside the swizzled buffer."""
    tile = (row // 128) * (cols_padded // 4) + col // 4
    r = row % 128
    return tile * 512 + (r % 32) * 16 + (r // 32) * 4 + col % 4


def _check_2d(scale: torch.Tensor, name: str) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (rows, K // 16), got {getattr(scale, 'shape', type(scale))}")


def to_swizzled_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Plain (rows, cols) scales -> swizzled ``(rows_padded, cols_padded)`` tensor.

    The result is contiguous; its memory is in swizzled order (the 2-D shape is
    only a convenient container, as in cuBLAS). Any dtype of one byte works
    (float8_e4m3fn, uint8); padding is zero bytes.
    """
    _check_2d(scale, "scale")
    rows, cols = scale.shape
    rows_p, cols_p = swizzled_128x4_shape(rows, cols)
    padded = torch.zeros((rows_p, cols_p), dtype=scale.dtype, device=scale.device)
    padded[:rows, :cols] = scale
    tiles = padded.view(rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(rows_p, cols_p)


def from_swizzled_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_swizzled_128x4`: returns the plain (rows, cols) scales."""
    _check_2d(swizzled, "swizzled")
    rows_p, cols_p = swizzled_128x4_shape(rows, cols)
    if tuple(swizzled.shape) != (rows_p, cols_p):
        raise ValueError(f"swizzled: expected shape {(rows_p, cols_p)} for ({rows}, {cols}) scales, "
                         f"got {tuple(swizzled.shape)}")
    tiles = swizzled.contiguous().view(rows_p // 128, cols_p // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rows_p, cols_p)[:rows, :cols].contiguous()


def to_triton_5d(scale: torch.Tensor) -> torch.Tensor:
    """Plain (rows, cols) scales -> ``[1, rows_p // 128, cols_p // 4, 2, 256]`` (Triton TMA scale layout)."""
    swizzled = to_swizzled_128x4(scale)
    rows_p, cols_p = swizzled.shape
    return swizzled.view(1, rows_p // 128, cols_p // 4, 2, 256)


def from_triton_5d(scale_5d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_triton_5d`."""
    if scale_5d.dim() != 5 or scale_5d.shape[0] != 1 or tuple(scale_5d.shape[3:]) != (2, 256):
        raise ValueError(f"scale_5d: expected shape [1, R//128, C//4, 2, 256], got {tuple(scale_5d.shape)}")
    rows_p, cols_p = swizzled_128x4_shape(rows, cols)
    if scale_5d.shape[1] * 128 != rows_p or scale_5d.shape[2] * 4 != cols_p:
        raise ValueError(f"scale_5d: shape {tuple(scale_5d.shape)} does not match ({rows}, {cols}) scales")
    return from_swizzled_128x4(scale_5d.reshape(rows_p, cols_p), rows, cols)


def interleave_weight_rows(packed: torch.Tensor, group: int = 4, step_bytes: int = 64) -> torch.Tensor:
    """Row-interleaved copy of a row-major (..., N, C) byte matrix (packed FP4 ``data``: C = K / 2, step_bytes 64 =
    one 128-K step; ``block_scale`` viewed as bytes: C = K / 16, step_bytes 8): rows ``g*group .. g*group+group-1``
    become one run per K step, ``group * step_bytes`` contiguous bytes (row r of the group at ``(r % group) *
    step_bytes`` in it), for longer DRAM bursts (the peer's Hopper value layout groups 4 rows the same way). Same
    shape and dtype; ``N % group == 0`` and ``C % step_bytes == 0``. The pipelined GEMM reads it with
    ``weight_interleave=group``."""
    return _swap_group_and_step(packed, group, step_bytes, inverse=False)


def deinterleave_weight_rows(packed: torch.Tensor, group: int = 4, step_bytes: int = 64) -> torch.Tensor:
    """The inverse of :func:`interleave_weight_rows` (row-major again)."""
    return _swap_group_and_step(packed, group, step_bytes, inverse=True)


def _swap_group_and_step(packed: torch.Tensor, group: int, step_bytes: int, *, inverse: bool) -> torch.Tensor:
    """(..., N, C) viewed as (N / group, group, steps, step_bytes) (row-major) or (N / group, steps, group,
    step_bytes) (interleaved, ``inverse``), the middle two axes swapped, as a contiguous tensor of the same shape."""
    n, c = packed.shape[-2], packed.shape[-1]
    if n % group or c % step_bytes:
        raise ValueError(f"packed: expected N % {group} == 0 and C % {step_bytes} == 0, got shape "
                         f"{tuple(packed.shape)}")
    middle = (c // step_bytes, group) if inverse else (group, c // step_bytes)
    x = packed.reshape(*packed.shape[:-2], n // group, *middle, step_bytes).transpose(-3, -2)
    return x.contiguous().reshape(packed.shape)
