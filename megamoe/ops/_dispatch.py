"""Where an op runs: Triton kernels or the PyTorch reference.

CUDA tensors always take the Triton kernels. CPU tensors take the pure-PyTorch
reference, unless the environment variable ``TRITON_INTERPRET=1`` is set, in
which case the Triton launchers run on the CPU tensors through the Triton
interpreter (slow; used by the test-suite to check kernels without a GPU).
The variable must be set before ``triton`` is imported.
"""
from __future__ import annotations

import os

import torch


def interpreter_enabled() -> bool:
    """True when the Triton interpreter was requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op given ``tensor`` should run its Triton launcher."""
    return tensor.is_cuda or (tensor.device.type == "cpu" and interpreter_enabled())


def resolve_device(device) -> torch.device:
    """'cuda' -> 'cuda:<current>' so that comparisons with tensors' devices hold (layers and caches store it).
    Raises ValueError naming ``device`` for a string torch does not parse, TypeError for another type."""
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise TypeError(f"device: expected a str, torch.device or CUDA index, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
