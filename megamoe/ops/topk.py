"""Public top-k selection of the V4 indexer: validation and dispatch.

``topk_indices(scores, k, out=None)``: the ``min(k, T)`` best entries of each row of float32 scores, as int32
indices, best first (semantics bit for bit ``megamoe.reference.topk.topk_indices``: ties to the lower index,
``-0.0 == +0.0``, NaN above ``+inf``, ``-1`` for ``-inf`` scores).

Dispatch (``megamoe.ops._dispatch.use_triton``): CUDA tensors -> the bucket-select kernels of
``megamoe/kernels/topk.py`` (per-shape plan ``PLAN`` there: short rows sorted whole by one program;
one program per row at large batch; at small batch each row split over several programs, three or four
launches with an in-kernel last-arriving merge and a parallel rank finish);
CPU tensors -> the reference, or the kernel through the
interpreter when ``TRITON_INTERPRET=1``. The Triton path is sync-free and CUDA-graph capturable: host
decisions use shapes only; it allocates the output (unless ``out`` is given) and a zeroed scratch buffer of
``workspace_entries(T, k, batch=B)`` int32 per row (pass ``workspace=`` to reuse one: zero it once before its first
use; every call leaves its arrival counters at zero).
"""
from __future__ import annotations

import torch

from ..reference import topk as _ref
from ._dispatch import interpreter_enabled, use_triton


def check_workspace(workspace, B: int, T: int, k: int, device, interpreter: bool) -> None:
    """Raise unless ``workspace`` is a contiguous (B, >= workspace_entries(T, k, batch=B)) int32 tensor on
    ``device``."""
    from ..kernels.topk import workspace_entries

    need = workspace_entries(T, k, interpreter=interpreter, batch=B)
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int32:
        raise TypeError("workspace: expected an int32 torch.Tensor")
    if workspace.dim() != 2 or workspace.shape[0] != B or workspace.shape[1] < need \
            or not workspace.is_contiguous() or workspace.device != device:
        raise ValueError(f"workspace: expected a contiguous (B={B}, >= {need}) int32 tensor on "
                         f"{device}, got {tuple(workspace.shape)} on {workspace.device}")


def check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k!r}")


def topk_indices(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None, tile_maxima: bool = False) -> torch.Tensor:
    """scores: (B, T) float32, contiguous; k >= 1 -> (B, min(k, T)) int32 (written into ``out`` if given:
    an int32 contiguous tensor of that shape on the scores' device). ``workspace``: optional
    (B, >= workspace_entries(T, k)) int32 contiguous scratch, zeroed once before first use (Triton path
    only). ``tile_maxima``: the indexer kernel wrote this call's per-tile maxima into ``workspace``
    (``megamoe.kvcache.ops.indexer_topk``; Triton path only)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores: expected a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype != torch.float32:
        raise TypeError(f"scores: expected dtype torch.float32, got {scores.dtype}")
    if scores.dim() != 2:
        raise ValueError(f"scores: expected a 2-D (B, T) tensor, got shape {tuple(scores.shape)}")
    if not scores.is_contiguous():
        raise ValueError("scores: expected a contiguous tensor")
    check_k(k)
    B, T = scores.shape
    K = min(k, T)
    if out is None:
        out = torch.empty((B, K), dtype=torch.int32, device=scores.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.int32:
            raise TypeError(f"out: expected dtype torch.int32, got {out.dtype}")
        if tuple(out.shape) != (B, K):
            raise ValueError(f"out: expected shape {(B, K)} = (B, min(k, T)), got {tuple(out.shape)}")
        if out.device != scores.device:
            raise ValueError(f"out: expected device {scores.device}, got {out.device}")
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    if B == 0 or K == 0:
        return out
    if use_triton(scores):
        from ..kernels.topk import launch_topk

        interp = interpreter_enabled() and not scores.is_cuda
        if workspace is not None:
            check_workspace(workspace, B, T, k, scores.device, interp)
        elif tile_maxima:
            raise ValueError("tile_maxima: needs the workspace the indexer kernel wrote them into")
        launch_topk(scores, out, workspace, interpreter=interp, tile_maxima=tile_maxima)
        return out
    out.copy_(_ref.topk_indices(scores, k))
    return out
