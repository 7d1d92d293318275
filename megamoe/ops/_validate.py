"""Argument checks shared by the ops (host metadata only: dtypes, ranks, devices, layouts; never device values)."""
from __future__ import annotations

import torch


def check_tensor(t, name: str, dtype: torch.dtype, dim: int, device=None, *, contiguous: bool = False) -> None:
    """Raise TypeError / ValueError naming ``name`` unless ``t`` is a ``dim``-D ``dtype`` tensor (on ``device``,
    contiguous when asked)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
