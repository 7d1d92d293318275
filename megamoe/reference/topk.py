"""Reference of the indexer's top-k selection (the semantics ``megamoe.kernels.topk`` reproduces bit for bit).

``topk_indices(scores, k)``: scores (B, T) float32 -> (B, min(k, T)) int32 entry indices, best first, ties to
the lower index, ``-0.0 == +0.0``, NaN above ``+inf``, ``-1`` where the selected score is ``-inf``. It is
``megamoe.reference.kvcache.select_topk`` (unique int64 keys + ``torch.topk``); ``topk_indices_sorted`` is
the same answer from a stable descending sort (an independent oracle for tests).
"""
from __future__ import annotations

import torch

from .kvcache import select_topk, select_topk_sorted


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) float32 -> (B, min(k, T)) int32 (see the module docstring)."""
    return select_topk(scores, k)


def topk_indices_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Same as :func:`topk_indices` by a stable sort (NaN-free inputs: ``torch.sort`` places NaN first
    in descending order regardless of sign, while the key map ranks a negative-signed NaN last)."""
    return select_topk_sorted(scores, k)
