"""The NVFP4 tensor container."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import BLOCK_SIZE


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape = (..., K)``.

    Attributes:
        data: uint8 ``(..., K // 2)``; two E2M1 codes per byte, low nibble =
            even element (bit 3 of each nibble is the sign).
        block_scale: torch.float8_e4m3fn ``(..., K // 16)``, plain row-major, one
            scale per 16 consecutive elements along K.
        global_scale: float32 tensor, 0-d (per tensor) or broadcastable to
            ``shape[:-1] + (1,)`` (per row; ``(E, 1, 1)`` per expert for stacked
            ``(E, N, K)`` weights).
        shape: the logical shape ``(..., K)``.
        row_interleave: the physical row order of ``data`` and ``block_scale`` along ``(N, K)`` (the last two
            dimensions): 1 (default) row-major, as above and as checkpoints store it; 4: groups of 4 rows
            interleaved per 128-K step (:func:`megamoe.format.layouts.interleave_weight_rows`: 256-byte runs that
            HBM streams faster, NOTES_gemm.md v21), read only by ``nvfp4_grouped_mm``'s Gluon routes on sm_90 (other
            ops refuse it; :meth:`rows_in_order` undoes it). Made by :meth:`interleave_rows`.

    Decoded value: ``e2m1(code) * (block_scale * global_scale)`` in float32.
    """

    data: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    row_interleave: int = 1

    def __post_init__(self):
        try:
            self.shape = torch.Size(self.shape)
        except TypeError as error:
            raise TypeError(f"shape: expected a sequence of ints, got {self.shape!r}") from error
        self.validate()

    def validate(self) -> None:
        """Check dtypes and shapes (host metadata only, never device values)."""
        for name in ("data", "block_scale", "global_scale"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                kind = type(value)
                raise TypeError(f"{name}: expected a torch.Tensor, got {kind.__module__}.{kind.__qualname__}"
                                if kind.__module__ != "builtins" else
                                f"{name}: expected a torch.Tensor, got {kind.__qualname__}")
        if not isinstance(self.shape, torch.Size) or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise ValueError(f"shape: expected non-negative ints, got {tuple(self.shape)}")
        if self.data.dtype != torch.uint8:
            raise TypeError(f"data: expected a uint8 tensor, got {getattr(self.data, 'dtype', type(self.data))}")
        if self.block_scale.dtype != torch.float8_e4m3fn:
            raise TypeError(
                "block_scale: expected a torch.float8_e4m3fn tensor, got "
                f"{getattr(self.block_scale, 'dtype', type(self.block_scale))}"
            )
        if self.global_scale.dtype != torch.float32:
            raise TypeError(
                "global_scale: expected a float32 tensor, got "
                f"{getattr(self.global_scale, 'dtype', type(self.global_scale))}"
            )
        if len(self.shape) < 1:
            raise ValueError("shape: expected at least one dimension (..., K)")
        k = self.shape[-1]
        if k % BLOCK_SIZE:
            raise ValueError(f"shape: last dimension K={k} must be a multiple of {BLOCK_SIZE}")
        lead = tuple(self.shape[:-1])
        if tuple(self.data.shape) != lead + (k // 2,):
            raise ValueError(f"data: expected shape {lead + (k // 2,)}, got {tuple(self.data.shape)}")
        if tuple(self.block_scale.shape) != lead + (k // BLOCK_SIZE,):
            raise ValueError(
                f"block_scale: expected shape {lead + (k // BLOCK_SIZE,)}, got {tuple(self.block_scale.shape)}"
            )
        if self.global_scale.dim() != 0:
            row_shape = lead + (1,)
            gs = tuple(self.global_scale.shape)
            ok = len(gs) == len(row_shape) and all(g in (1, r) for g, r in zip(gs, row_shape)) and gs[-1] == 1
            if not ok:
                raise ValueError(
                    f"global_scale: expected a 0-d tensor or a shape broadcastable to {row_shape} "
                    f"with last dimension 1, got {gs}"
                )
        if type(self.row_interleave) is not int or self.row_interleave not in (1, 4):
            raise ValueError(f"row_interleave: expected 1 or 4, got {self.row_interleave!r}")
        if self.row_interleave > 1 and (len(self.shape) < 2 or self.shape[-2] % self.row_interleave or k % 128):
            raise ValueError(f"row_interleave: {self.row_interleave} needs N % {self.row_interleave} == 0 and "
                             f"K % 128 == 0 for shape (..., N, K), got {tuple(self.shape)}")
        devices = {self.data.device, self.block_scale.device, self.global_scale.device}
        if len(devices) != 1:
            raise ValueError(f"data, block_scale and global_scale must share one device, got {devices}")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def per_tensor(self) -> bool:
        """True when one global scale covers the whole tensor."""
        return self.global_scale.numel() == 1

    def to(self, device) -> "NVFP4Tensor":
        """Copy to ``device`` (not for hot paths)."""
        return NVFP4Tensor(
            self.data.to(device), self.block_scale.to(device), self.global_scale.to(device), self.shape,
            self.row_interleave,
        )

    def interleave_rows(self, group: int = 4) -> "NVFP4Tensor":
        """A copy with ``row_interleave = group`` (from row-major; not for hot paths)."""
        from .layouts import interleave_weight_rows

        if self.row_interleave != 1:
            raise ValueError(f"row_interleave: already {self.row_interleave}; interleave a row-major tensor")
        NVFP4Tensor(self.data, self.block_scale, self.global_scale, self.shape, group)  # shape checks
        return self._rows_permuted(interleave_weight_rows, group, group)

    def rows_in_order(self) -> "NVFP4Tensor":
        """The row-major tensor (itself when ``row_interleave`` is 1, else a copy; not for hot paths)."""
        from .layouts import deinterleave_weight_rows

        if self.row_interleave == 1:
            return self
        return self._rows_permuted(deinterleave_weight_rows, self.row_interleave, 1)

    def _rows_permuted(self, permute, group: int, row_interleave: int) -> "NVFP4Tensor":
        """``permute(bytes, group, step_bytes)`` applied to the data (64 bytes per 128-K step) and the scales (8)."""
        scale = permute(self.block_scale.view(torch.uint8), group, 8).view(self.block_scale.dtype)
        return NVFP4Tensor(permute(self.data, group, 64), scale, self.global_scale, self.shape, row_interleave)

    def nbytes(self) -> int:
        """Bytes of packed data + block scales + global scales."""
        return (
            self.data.numel() + self.block_scale.numel() + 4 * self.global_scale.numel()
        )
