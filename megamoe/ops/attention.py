"""DeepSeek-V4 sparse FP8 MQA attention (decode and prefill): validation + dispatch.

:func:`sparse_mqa_attention` runs the Triton kernel (``megamoe/kernels/sparse_attention.py``) on CUDA tensors
or under the interpreter (``TRITON_INTERPRET=1``), the float32 reference (``megamoe/reference/attention.py``)
otherwise. Sync-free and CUDA-graph capturable on the Triton path (host decisions on shapes only); pass
``out`` and ``workspace`` (:func:`attention_workspace`) to keep pointers fixed across replays.
"""
from __future__ import annotations

import math

import torch

from ..reference import attention as _reference
from . import errors
from ._dispatch import interpreter_enabled, resolve_device, use_triton
from ._validate import check_int, check_tensor


def _check(t, name: str, dtype: torch.dtype, dim: int, device=None) -> None:
    check_tensor(t, name, dtype, dim, device, contiguous=True)


def _expect_shape(t, name: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_num_splits(num_splits) -> None:
    """None or a positive int (the op's override of the split count)."""
    if num_splits is not None:
        check_int(num_splits, "num_splits", 1)


def attention_workspace(num_tokens: int, num_heads: int, head_dim: int, window: int, topk: int, device,
                        num_splits: int | None = None):
    """Preallocated split-KV workspace for these shapes ((acc, ml) float32 tensors), or None if no split is used.

    Allocate it once outside a captured graph and pass it as ``workspace=`` to keep the pointers fixed.
    Arguments (the shapes of the :func:`sparse_mqa_attention` calls it serves; Python ints, not bools):
    num_tokens: N >= 0 queries (0: nothing to split, returns None); num_heads: H >= 1; head_dim: D >= 1;
    window: W >= 0 window ids per query; topk: K >= 0 entry ids per query; device: a ``torch.device``, a device
    string or a CUDA index (CUDA: sized for the GPU kernels, else for the interpreter's blocks); num_splits:
    None (chosen from the shapes, as the op does) or the op's positive ``num_splits`` override.
    TypeError for an argument of another type, ValueError for a value out of range or an unknown device.
    """
    from ..kernels import sparse_attention as kernels

    check_int(num_tokens, "num_tokens", 0)
    check_int(num_heads, "num_heads", 1)
    check_int(head_dim, "head_dim", 1)
    check_int(window, "window", 0)
    check_int(topk, "topk", 0)
    _check_num_splits(num_splits)
    device = resolve_device(device)
    if num_tokens == 0:
        return None
    interp = device.type != "cuda"
    if num_splits is None:
        splits, _ = kernels.choose_num_splits(num_tokens, num_heads, window, topk, interpreter=interp)
    else:
        cfg = kernels.INTERPRETER_CONFIG if interp else kernels.ATTENTION_CONFIG
        blocks = -(-window // cfg["BLOCK_N"]) + -(-topk // cfg["BLOCK_N"])
        splits, _ = kernels.split_layout(blocks, num_splits)
    if splits <= 1:
        return None
    acc_shape, ml_shape = kernels.workspace_shapes(num_tokens, num_heads, head_dim, splits)
    return (torch.empty(acc_shape, dtype=torch.float32, device=device),
            torch.empty(ml_shape, dtype=torch.float32, device=device))


def sparse_mqa_attention(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale,
                         entries_rope, block_table, slots, entry_idx, out=None, num_splits: int | None = None,
                         workspace=None) -> torch.Tensor:
    """Sparse MQA attention of DeepSeek-V4 over window rows + paged FP8 compressed entries.

    q: (N, H, D) bf16 queries (decode: one per batch row; prefill: the chunk's tokens).
    attn_sink: (H,) float32 per-head sink logit (denominator only). softmax_scale: python float (D**-0.5).
    window_kv: (R, D) bf16 rows; window_idx: (N, W) int32 ids into window_kv (-1 = none; W may be 0).
    entries_fp8: (P, EPB, nope) float8_e4m3fn; entries_scale: (P, EPB, nope // SB) float32, one scale per SB
    consecutive nope dims (SB a multiple of 16; 64 in V4, or SB = nope: one scale per entry);
    entries_rope: (P, EPB, rope) bf16 with nope + rope = D, rope % 16 == 0.
    block_table: (S, L) int32 physical page of each slot's logical page (-1 = none); slots: (N,) int32 request
    slot of each query; entry_idx: (N, K) int32 logical entry of that request (-1 = none; K may be 0).
    N = 0 (an empty chunk) returns an empty (0, H, D) result (``out`` when given) on both paths.
    out: optional (N, H, D) bf16 output buffer. num_splits: split-KV override (None = chosen from shapes).
    workspace: optional split-KV buffers from :func:`attention_workspace` (graph-stable pointers).
    Returns (N, H, D) bf16. Invalid / out-of-range indices are skipped (see ``megamoe/reference/attention.py``);
    a query without valid rows outputs zeros. All tensors contiguous on q's device.

    Errors (no host sync; ``megamoe/ops/errors.py``, read by ``megamoe.check_errors()``): -1 is the legitimate
    "none" marker of window ids, entry ids, slots and pages. Otherwise a window id ``< -1`` or ``>= R`` sets
    ``("sparse_attention", "window_idx")``; an entry id ``< -1`` or whose logical page is ``>= L`` (of a query
    with a valid slot) ``("sparse_attention", "entry_idx")``; a slot ``< -1`` or ``>= S`` when K > 0 (without
    entry ids the slot is not used: window-only layers pass a dummy table) ``("sparse_attention", "slots")``;
    a page id ``< -1`` or ``>= P`` looked up for a listed entry
    ``("sparse_attention", "block_table")``. The flagged indices are skipped, as above; both backends agree.
    """
    _check(q, "q", torch.bfloat16, 3)
    dev = q.device
    N, H, D = q.shape
    if H < 1 or D < 1:
        raise ValueError(f"q: expected H >= 1 heads and D >= 1 dims, got shape {tuple(q.shape)}")
    _check(attn_sink, "attn_sink", torch.float32, 1, dev)
    _expect_shape(attn_sink, "attn_sink", (H,))
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or \
            not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale: expected a finite python float, got {softmax_scale!r}")
    _check(window_kv, "window_kv", torch.bfloat16, 2, dev)
    if window_kv.shape[1] != D:
        raise ValueError(f"window_kv: expected {D} columns (q's D), got shape {tuple(window_kv.shape)}")
    _check(window_idx, "window_idx", torch.int32, 2, dev)
    if window_idx.shape[0] != N:
        raise ValueError(f"window_idx: expected {N} rows (q's N), got shape {tuple(window_idx.shape)}")
    _check(entries_fp8, "entries_fp8", torch.float8_e4m3fn, 3, dev)
    P, epb, nope = entries_fp8.shape
    if epb < 1:
        raise ValueError(f"entries_fp8: expected >= 1 entries per page, got shape {tuple(entries_fp8.shape)}")
    _check(entries_rope, "entries_rope", torch.bfloat16, 3, dev)
    if tuple(entries_rope.shape[:2]) != (P, epb):
        raise ValueError(f"entries_rope: expected shape ({P}, {epb}, rope), got {tuple(entries_rope.shape)}")
    rope = entries_rope.shape[2]
    if nope + rope != D:
        raise ValueError(f"entries_fp8/entries_rope: nope ({nope}) + rope ({rope}) must equal D ({D})")
    if nope < 16 or rope % 16:
        raise ValueError(f"entries_rope: rope dims must be a multiple of 16 and nope >= 16, got rope={rope}, "
                         f"nope={nope}")
    _check(entries_scale, "entries_scale", torch.float32, 3, dev)
    nsc = entries_scale.shape[2]
    if tuple(entries_scale.shape[:2]) != (P, epb) or nsc < 1 or nope % nsc or (nope // nsc) % 16:
        raise ValueError(f"entries_scale: expected shape ({P}, {epb}, nope // SB) with the scale block SB a "
                         f"multiple of 16 dividing nope={nope}, got {tuple(entries_scale.shape)}")
    _check(block_table, "block_table", torch.int32, 2, dev)
    _check(slots, "slots", torch.int32, 1, dev)
    _expect_shape(slots, "slots", (N,))
    _check(entry_idx, "entry_idx", torch.int32, 2, dev)
    if entry_idx.shape[0] != N:
        raise ValueError(f"entry_idx: expected {N} rows (q's N), got shape {tuple(entry_idx.shape)}")
    if out is not None:
        _check(out, "out", torch.bfloat16, 3, dev)
        _expect_shape(out, "out", (N, H, D))
    _check_num_splits(num_splits)
    if workspace is not None:
        if not (isinstance(workspace, (tuple, list)) and len(workspace) == 2):
            raise TypeError("workspace: expected the (acc, ml) pair of attention_workspace()")
        for i, t in enumerate(workspace):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"workspace[{i}]: expected a float32 torch.Tensor (from attention_workspace()), got "
                                f"{type(t).__name__}")
            check_tensor(t, f"workspace[{i}]", torch.float32, t.dim(), dev, contiguous=True)

    if N == 0:  # an empty batch (T = 0 chunk): nothing to attend, on either path
        return out if out is not None else torch.empty((0, H, D), dtype=torch.bfloat16, device=dev)

    if not use_triton(q):
        _record_errors(window_kv.shape[0], window_idx, entries_fp8.shape[0], epb, block_table, slots, entry_idx)
        return _reference.sparse_mqa_attention(
            q, attn_sink, softmax_scale, window_kv=window_kv, window_idx=window_idx, entries_fp8=entries_fp8,
            entries_scale=entries_scale, entries_rope=entries_rope, block_table=block_table, slots=slots,
            entry_idx=entry_idx, out=out)
    from ..kernels.sparse_attention import launch_sparse_mqa_attention

    if out is None:
        out = torch.empty((N, H, D), dtype=torch.bfloat16, device=dev)
    return launch_sparse_mqa_attention(
        q, attn_sink, float(softmax_scale), window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
        block_table, slots, entry_idx, out, num_splits=num_splits, workspace=workspace,
        interpreter=interpreter_enabled() and not q.is_cuda, error_word=errors.error_word(dev))


def _record_errors(num_rows: int, window_idx, num_pages: int, epb: int, block_table, slots, entry_idx) -> None:
    """Torch path: the kernel's error flags (see :func:`sparse_mqa_attention`), by the same rules, as device ops."""
    word = errors.error_word(window_idx.device)
    w = window_idx.long()
    errors.record(word, errors.flag("sparse_attention", "window_idx"), (w < -1) | (w >= num_rows))
    S, L = block_table.shape
    slot = slots.long()
    slot_ok = (slot >= 0) & (slot < S)
    if entry_idx.shape[1]:  # the slot only addresses the block table: no entries, nothing to flag
        errors.record(word, errors.flag("sparse_attention", "slots"), (slot < -1) | (slot >= S))
    e = torch.where(slot_ok[:, None], entry_idx.long(), -1)
    logical = torch.where(e >= 0, torch.div(e, epb, rounding_mode="floor"), 0)
    errors.record(word, errors.flag("sparse_attention", "entry_idx"), (e < -1) | ((e >= 0) & (logical >= L)))
    if S and L:
        looked_up = (e >= 0) & (logical < L)
        page = block_table.long()[torch.where(slot_ok, slot, 0)[:, None], torch.where(looked_up, logical, 0)]
        page = torch.where(looked_up, page, -1)
        errors.record(word, errors.flag("sparse_attention", "block_table"), (page < -1) | (page >= num_pages))
