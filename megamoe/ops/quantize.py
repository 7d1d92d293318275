"""Public NVFP4 quantize / dequantize ops: validation and dispatch.

Semantics (bit for bit) are those of ``megamoe/reference/quantize.py``: read
its docstring for the rounding rules and the zero / underflow / NaN policy.

Dispatch (``megamoe.ops._dispatch.use_triton``): CUDA tensors -> the fused
Triton kernels of ``megamoe/kernels/quantize.py``; CPU tensors -> the PyTorch
reference, or the Triton kernels through the interpreter when
``TRITON_INTERPRET=1``.

The Triton path is sync-free and CUDA-graph capturable: validation reads host
metadata only (shapes, dtypes, devices), device values are never read on the
host, and the only allocations are the outputs (and, per-tensor dynamic mode, a
scratch buffer of at most 512 floats); pass ``out=`` to reuse buffers.
Launches: given global scale 1 (single pass); dynamic per-row 1 (amax and
quantize in one kernel); dynamic per-tensor 2 (amax partials, then a quantize
kernel that reduces the partials itself). ``M = 0`` (or ``K = 0``) launches
nothing. A non-contiguous ``x`` is copied to a contiguous one first.
"""
from __future__ import annotations

import torch

from ..format.constants import AMAX_FLOOR, BLOCK_SIZE, GLOBAL_SCALE_DIVISOR
from ..format.layouts import swizzled_128x4_shape, to_swizzled_128x4
from ..format.tensor import NVFP4Tensor
from ..reference.quantize import check_global_scale, check_quantize_input
from ..reference.quantize import compute_global_scale as _reference_compute_global_scale
from ..reference.quantize import dequantize as _reference_dequantize
from ..reference.quantize import quantize as _reference_quantize
from ._dispatch import interpreter_enabled, use_triton

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernels():
    from ..kernels import quantize as kernels  # imported lazily: triton only when needed

    return kernels


def _check_swizzled(buf, rows: int, cols: int, x: torch.Tensor) -> None:
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"swizzled_scale_out: expected a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"swizzled_scale_out: expected uint8 or float8_e4m3fn, got {buf.dtype}")
    want = swizzled_128x4_shape(rows, cols)
    if tuple(buf.shape) != want:
        raise ValueError(f"swizzled_scale_out: expected shape {want} (128x4 swizzled scales of ({rows}, {cols})), "
                         f"got {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError("swizzled_scale_out: expected a contiguous tensor")
    if buf.device != x.device:
        raise ValueError(f"swizzled_scale_out: expected device {x.device} (x's), got {buf.device}")


def _check_out(out, x: torch.Tensor, gs_shape: tuple | None) -> None:
    if out is None:
        return
    if not isinstance(out, NVFP4Tensor):
        raise TypeError(f"out: expected an NVFP4Tensor, got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"out: expected logical shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out: expected device {x.device} (x's), got {out.device}")
    if not (out.data.is_contiguous() and out.block_scale.is_contiguous()):
        raise ValueError("out: expected contiguous data and block_scale")
    if gs_shape is not None and (tuple(out.global_scale.shape) != gs_shape or not out.global_scale.is_contiguous()):
        raise ValueError(f"out: expected a contiguous global_scale of shape {gs_shape}, got "
                         f"{tuple(out.global_scale.shape)}")


def _empty_global_scale(shape: tuple, device) -> torch.Tensor:
    """Computed global scale of an empty tensor / rows (amax floor), without a kernel."""
    return torch.full(shape, AMAX_FLOOR, dtype=torch.float32, device=device) / GLOBAL_SCALE_DIVISOR


def _per_row_vector(gs: torch.Tensor, lead: tuple, rows: int) -> torch.Tensor:
    """Broadcastable (..., 1) global scale -> (rows,) contiguous float32 (a view when already dense)."""
    return gs.expand(lead + (1,)).reshape(rows).contiguous()


def compute_global_scale(x: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """Dynamic global scale ``max(finite amax, 2**-100) / 2688`` of ``x``, sync-free.

    x: (..., K) float32/bf16/fp16, K % 16 == 0.
    Returns float32: 0-d (per tensor) or ``x.shape[:-1] + (1,)`` (``per_row=True``).
    """
    check_quantize_input(x)
    lead = tuple(x.shape[:-1])
    shape = lead + (1,) if per_row else ()
    if not use_triton(x):
        return _reference_compute_global_scale(x, per_row=per_row)
    if x.numel() == 0:
        return _empty_global_scale(shape, x.device)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    kernels = _kernels()
    interp = interpreter_enabled() and not x.is_cuda
    out = torch.empty(shape, dtype=torch.float32, device=x.device)
    partials = None
    if not per_row:
        partials = torch.empty(kernels.amax_partials_count(x2.numel(), interp), dtype=torch.float32, device=x.device)
    kernels.launch_quantize(x2, None, None, out, per_row=per_row, partials=partials, scale_only=True,
                            interpreter=interp)
    return out


def quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    *,
    per_row: bool = False,
    swizzled_scale_out: torch.Tensor | None = None,
    out: NVFP4Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 (fused kernels on CUDA; exact reference semantics).

    x: (..., K) float32/bfloat16/float16, K % 16 == 0, any leading dims (M rows
        after flattening; M = 0 allowed).
    global_scale: None -> computed on the device (0-d, or ``(..., 1)`` with
        ``per_row=True``); or a float32 tensor on x's device, 0-d or
        broadcastable to ``x.shape[:-1] + (1,)``, positive and finite (not
        checked: that would need a host sync). ``per_row`` is ignored then.
    swizzled_scale_out: optional contiguous uint8/float8_e4m3fn buffer of shape
        ``swizzled_128x4_shape(M, K // 16)``; receives the block scales in the
        128x4 swizzled layout, padding written as zeros (need not be zeroed).
    out: optional preallocated NVFP4Tensor of x's shape whose data and
        block_scale are written (and, for a computed scale, its global_scale,
        which must then be 0-d or ``x.shape[:-1] + (1,)`` as above).

    Returns NVFP4Tensor: data (..., K // 2) uint8 (low nibble = even element),
    block_scale (..., K // 16) float8_e4m3fn, global_scale float32 (the given
    one, 0-d when it has one element, or the computed one).
    """
    check_quantize_input(x)
    if not isinstance(per_row, bool):
        raise TypeError(f"per_row: expected a bool, got {per_row!r}")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    rows = x.numel() // k if k else int(torch.Size(lead).numel())
    if global_scale is not None:
        global_scale = check_global_scale(global_scale, x)
        gs_shape = None
    else:
        gs_shape = lead + (1,) if per_row else ()
    _check_swizzled(swizzled_scale_out, rows, k // BLOCK_SIZE, x)
    _check_out(out, x, gs_shape)

    if not use_triton(x):
        result = _reference_quantize(x, global_scale, per_row=per_row)
        if swizzled_scale_out is not None:
            swz = to_swizzled_128x4(result.block_scale.reshape(rows, k // BLOCK_SIZE).view(torch.uint8))
            swizzled_scale_out.view(torch.uint8).copy_(swz)
        if out is not None:
            out.data.copy_(result.data)
            out.block_scale.copy_(result.block_scale)
            if gs_shape is not None:
                out.global_scale.copy_(result.global_scale)
            return NVFP4Tensor(out.data, out.block_scale, out.global_scale if gs_shape is not None
                               else result.global_scale, x.shape)
        return result

    if out is not None:
        data, block_scale = out.data, out.block_scale
        gs_out = out.global_scale if gs_shape is not None else None
    else:
        data = torch.empty(lead + (k // 2,), dtype=torch.uint8, device=x.device)
        block_scale = torch.empty(lead + (k // BLOCK_SIZE,), dtype=torch.float8_e4m3fn, device=x.device)
        gs_out = torch.empty(gs_shape, dtype=torch.float32, device=x.device) if gs_shape is not None else None
    if x.numel() == 0:
        if gs_out is not None:
            gs_out.copy_(_empty_global_scale(gs_shape, x.device))
        if swizzled_scale_out is not None:
            swizzled_scale_out.zero_()
        return NVFP4Tensor(data, block_scale, gs_out if gs_out is not None else global_scale, x.shape)

    kernels = _kernels()
    interp = interpreter_enabled() and not x.is_cuda
    x2 = x.reshape(rows, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    gs_in = None
    if global_scale is not None:
        gs_in = global_scale.reshape(1) if global_scale.dim() == 0 else _per_row_vector(global_scale, lead, rows)
    partials = None
    if global_scale is None and not per_row:
        partials = torch.empty(kernels.amax_partials_count(x2.numel(), interp), dtype=torch.float32, device=x.device)
    swz = swizzled_scale_out.view(torch.uint8) if swizzled_scale_out is not None else None
    kernels.launch_quantize(
        x2, data.view(rows, k // 2), block_scale.view(torch.uint8).view(rows, k // BLOCK_SIZE),
        gs_out, global_scale=gs_in, per_row=per_row, partials=partials, swizzled=swz, interpreter=interp,
    )
    return NVFP4Tensor(data, block_scale, gs_out if gs_out is not None else global_scale, x.shape)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize: ``e2m1(code) * (block_scale * global_scale)`` in float32, rounded to ``dtype``.

    t: NVFP4Tensor of logical shape (..., K).
    dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
    out: optional contiguous tensor of shape t.shape and ``dtype`` on t's device.
    Returns a (..., K) tensor of ``dtype``.
    """
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    t.validate()
    t = t.rows_in_order()  # a row-interleaved kernel layout (NVFP4Tensor.row_interleave): row-major first (a copy)
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype != dtype:
            raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
        if out.shape != t.shape or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor of shape {tuple(t.shape)}, got {tuple(out.shape)}")
        if out.device != t.device:
            raise ValueError(f"out: expected device {t.device} (t's), got {out.device}")
    if not use_triton(t.data):
        result = _reference_dequantize(t, dtype)
        return out.copy_(result) if out is not None else result
    lead, k = tuple(t.shape[:-1]), t.shape[-1]
    result = out if out is not None else torch.empty(t.shape, dtype=dtype, device=t.device)
    if result.numel() == 0:
        return result
    rows = result.numel() // k
    gs = t.global_scale
    gs = gs.reshape(1) if gs.numel() == 1 else _per_row_vector(gs, lead, rows)
    kernels = _kernels()
    kernels.launch_dequantize(
        t.data.reshape(rows, k // 2).contiguous(),
        t.block_scale.view(torch.uint8).reshape(rows, k // BLOCK_SIZE).contiguous(),
        gs, result.view(rows, k), interpreter=interpreter_enabled() and not t.data.is_cuda,
    )
    return result
