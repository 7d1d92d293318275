"""Argument checks shared by the ops (host metadata only: dtypes, ranks, devices, layouts; never device values)."""
from __future__ import annotations

import math
import numbers

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


def check_int(value, name: str, minimum: int | None = None) -> int:
    """Raise TypeError naming ``name`` unless ``value`` is a Python int (not a bool), ValueError if it is below
    ``minimum``; return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_bool(value, name: str) -> bool:
    """Raise TypeError naming ``name`` unless ``value`` is a Python bool; return it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def check_positive_finite(value, name: str) -> float:
    """Raise TypeError naming ``name`` unless ``value`` is a real number (int or float, not a bool), ValueError
    unless it is finite and > 0; return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a finite positive number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not value > 0:
        raise ValueError(f"{name}: expected a finite positive number, got {value!r}")
    return float(value)


def check_real(value, name: str, *, non_negative: bool = False) -> None:
    """Raise TypeError naming ``name`` unless ``value`` is a real number (Python / NumPy float or int, not a bool or
    a tensor), ValueError unless it is finite (and, with ``non_negative``, >= 0): an epsilon or a scale factor."""
    want = "a finite float >= 0" if non_negative else "a finite float"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {want}, got {value!r}")
    if not math.isfinite(value) or (non_negative and value < 0):
        raise ValueError(f"{name}: expected {want}, got {value!r}")


def check_vector(t, name: str, dtype: torch.dtype, device, *, at_least: int | None = None,
                 exactly: int | None = None) -> None:
    """Raise TypeError / ValueError naming ``name`` unless ``t`` is a contiguous 1-D ``dtype`` tensor on ``device``
    with at least ``at_least`` (or exactly ``exactly``) elements: a buffer an op writes in place (a copy would not
    be written back) or a kernel reads as flat memory."""
    check_tensor(t, name, dtype, 1, device, contiguous=True)
    if exactly is not None and t.shape[0] != exactly:
        raise ValueError(f"{name}: expected exactly {exactly} elements, got {t.shape[0]}")
    if at_least is not None and t.shape[0] < at_least:
        raise ValueError(f"{name}: expected at least {at_least} elements, got {t.shape[0]}")
