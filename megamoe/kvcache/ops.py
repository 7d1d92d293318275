"""Functional steps of the compressed cache: validation and dispatch (Triton kernels or references).

Dispatch rule (``megamoe.ops._dispatch.use_triton``): CUDA tensors -> Triton; CPU tensors -> the PyTorch
reference, or the Triton launcher through the interpreter when ``TRITON_INTERPRET=1``. Nothing here
reads device values on the host, so every step is sync-free and CUDA-graph capturable on the Triton path.
Device-valued indices out of range (slot outside ``[0, S)``, negative position, page id outside the pool)
make the affected row a no-op / a zero read / a ``-inf`` score on both paths (kernels and references).
"""
from __future__ import annotations

import torch

from ..ops._dispatch import interpreter_enabled, use_triton
from .state import CompressorState, PagedPool


def _ref():
    from ..reference import kvcache as ref  # late import: reference.kvcache imports this package's modules
    return ref


def _check(t, name: str, dtype, shape: tuple, device=None, *, rows: bool = False) -> None:
    """dtype, shape, device and layout of ``t``: contiguous, or with ``rows`` only unit stride along the last dim
    (strided rows: column views of a fused projection's output)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if rows:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride along the last dimension, got strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def _rows_of(t, name: str, dim: int, what: str) -> int:
    """``t``'s leading size after checking that it is a ``dim``-D tensor (``what`` names the expected layout)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D {what} tensor, got shape {tuple(t.shape)}")
    return t.shape[0]


def _check_pool(pool) -> None:
    if not isinstance(pool, PagedPool):
        raise TypeError(f"pool: expected a PagedPool, got {type(pool).__name__}")


def _check_state(state) -> None:
    if not isinstance(state, CompressorState):
        raise TypeError(f"state: expected a CompressorState, got {type(state).__name__}")


def _check_ratio(ratio) -> None:
    """Tokens per compressed entry: any int >= 1 (``CompressedCacheConfig.ratio``; V4: 4 for CSA, 128 for HCA)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        raise TypeError(f"ratio: expected an int >= 1 (the cache's compress ratio), got {ratio!r}")
    if ratio < 1:
        raise ValueError(f"ratio: expected an int >= 1 (the cache's compress ratio), got {ratio!r}")


def _check_batch(slots, positions, active, B: int, device) -> None:
    _check(slots, "slots", torch.int32, (B,), device)
    _check(positions, "positions", torch.int32, (B,), device)
    if active is not None:
        _check(active, "active", torch.bool, (B,), device)


def _check_table(block_table, device) -> None:
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError("block_table: expected a 2-D int32 tensor")
    if block_table.device != device or not block_table.is_contiguous():
        raise ValueError(f"block_table: expected a contiguous tensor on {device}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(pages, epb, ...) -> (pages * epb, ...) view."""
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def compressor_step(state: CompressorState, kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, active: torch.Tensor, pooled: torch.Tensor,
                    flush: torch.Tensor, ape: torch.Tensor | None = None) -> None:
    """Append one token per active row to its slot's tail; rows reaching a multiple of m pool and rotate.

    kv, score: (B, C * D) float32, C = 2 for CSA (``[:D]`` overlap half, ``[D:]`` main half), 1 for HCA; unit
    stride along C * D, rows may be strided (column views of the attention layer's fused projection output).
    slots, positions: (B,) int32 (position of the appended token); active: (B,) bool.
    pooled: (B, D) float32 output (rows that flush are written, others untouched).
    flush: (B,) bool output (active and ``(pos + 1) % m == 0``). ``state`` is mutated in place.
    A row whose slot is outside ``[0, S)`` or whose position is negative counts as inactive.
    ape: (m, C * D) float32 or None: the gate scores used are ``score + ape[pos mod m]`` (the official absolute
    position embedding, one float32 add; inside the kernel on the Triton path, so ``score`` itself is unchanged).
    """
    _check_state(state)
    B = _rows_of(kv, "kv", 2, "(B, C * D) float32")
    dev = kv.device
    _check(kv, "kv", torch.float32, (B, state.cols), dev, rows=True)
    _check(score, "score", torch.float32, (B, state.cols), dev, rows=True)
    _check_batch(slots, positions, active, B, dev)
    _check(pooled, "pooled", torch.float32, (B, state.width), dev)
    _check(flush, "flush", torch.bool, (B,), dev)
    if ape is not None:
        _check(ape, "ape", torch.float32, (state.ratio, state.cols), dev)
    if use_triton(kv):
        from ..kernels.kvcache.compress import launch_compress_step
        launch_compress_step(kv, score, slots, positions, active.view(torch.int8), state.tail_k, state.tail_z,
                             state.tail_kb, state.tail_zb, state.tail_len, pooled, flush.view(torch.int8),
                             ratio=state.ratio, width=state.width, overlap=state.overlap, ape=ape)
        return
    _record_row_errors("compressor_step", active, slots, positions, state.tail_len.shape[0])
    if ape is not None:
        score = score + ape[torch.remainder(positions.long(), state.ratio)]
    out, fl = _ref().compressor_step(state, kv, score, slots, positions, active, pooled_out=pooled)
    pooled.copy_(out)
    flush.copy_(fl)


def flush_write(pool: PagedPool, block_table: torch.Tensor, entry: torch.Tensor, index_key: torch.Tensor | None,
                flush: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, *, ratio: int) -> None:
    """Quantize + scatter the flushing rows' entries into the pool (others: no-op, inside the kernel).

    entry: (B, head_dim) bf16 (last rope_dim dims stored bf16, the rest FP8 with float32 scales, per
    ``pool.entry_numerics``); index_key: (B, index_head_dim) bf16 for CSA (stored FP4 per
    ``pool.index_numerics``), None for HCA; flush: (B,) bool;
    slots, positions: (B,) int32 (row b writes entry ``positions[b] // ratio``); block_table: (S, L) int32.
    ratio: the cache's compress ratio (``CompressedCacheConfig.ratio``: an int >= 1; V4: 4 CSA, 128 HCA).
    """
    _check_pool(pool)
    B = _rows_of(entry, "entry", 2, "(B, head_dim) bf16")
    dev = entry.device
    nope, rope = pool.entries_fp8.shape[-1], pool.entries_rope.shape[-1]
    _check(entry, "entry", torch.bfloat16, (B, nope + rope), dev)
    if (index_key is None) != (pool.index_keys is None):
        raise ValueError("index_key: expected a (B, index_head_dim) bf16 tensor exactly when the pool has "
                         "indexer keys (CSA)")
    if index_key is not None:
        _check(index_key, "index_key", torch.bfloat16, (B, pool.index_keys.shape[-1] * 2), dev)
    _check(flush, "flush", torch.bool, (B,), dev)
    _check_batch(slots, positions, None, B, dev)
    _check_table(block_table, dev)
    _check_ratio(ratio)
    if use_triton(entry):
        from ..kernels.kvcache.flush import launch_flush_write
        keys = None if index_key is None else _flat(pool.index_keys)
        key_scale = None if index_key is None else _flat(pool.index_key_scale).view(torch.uint8)
        launch_flush_write(entry, index_key, flush.view(torch.int8), slots, positions, block_table,
                           _flat(pool.entries_fp8).view(torch.uint8), _flat(pool.entries_scale),
                           _flat(pool.entries_rope).view(torch.int16), keys, key_scale,
                           ratio=ratio, entries_per_block=pool.entries_per_block,
                           official_entry=pool.entry_numerics == "official",
                           official_key=pool.index_numerics == "official")
        return
    _record_flush_errors(pool, block_table, flush, slots, positions, ratio)
    _ref().flush_write(pool, block_table, entry, index_key, flush, slots, positions, ratio)


def _record_row_errors(op: str, wants: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path: the ``slots`` / ``positions`` flags of ``op`` (megamoe/ops/errors.py) for the rows that
    ``wants`` (active / flushing): slot < -1 or >= num_slots, position < -1 (-1 is the "none" marker).
    Returns (slot_ok, the long positions)."""
    from ..ops import errors

    word = errors.error_word(slots.device)
    slot, pos = slots.long(), positions.long()
    errors.record(word, errors.flag(op, "slots"), wants & ((slot < -1) | (slot >= num_slots)))
    errors.record(word, errors.flag(op, "positions"), wants & (pos < -1))
    return (slot >= 0) & (slot < num_slots), pos


def _record_flush_errors(pool: PagedPool, block_table: torch.Tensor, flush: torch.Tensor, slots: torch.Tensor,
                         positions: torch.Tensor, ratio: int) -> None:
    """Torch path: the flush kernel's error flags, by the same rules, as device ops."""
    from ..ops import errors

    num_slots, max_lb = block_table.shape
    slot_ok, pos = _record_row_errors("flush_write", flush, slots, positions, num_slots)
    live = flush & slot_ok & (pos >= 0)
    logical = torch.div(torch.where(live, pos, 0), ratio * pool.entries_per_block, rounding_mode="floor")
    word = errors.error_word(slots.device)
    errors.record(word, errors.flag("flush_write", "positions"), live & (logical >= max_lb))
    looked_up = live & (logical < max_lb)
    if num_slots and max_lb:
        page = block_table.long()[torch.where(slot_ok, slots.long(), 0), torch.where(looked_up, logical, 0)]
        page = torch.where(looked_up, page, -1)
        errors.record(word, errors.flag("flush_write", "block_table"),
                      (page < -1) | (page >= pool.entries_fp8.shape[0]))


def gather_entries(pool: PagedPool, block_table: torch.Tensor, slots: torch.Tensor, indices: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize selected entries: indices (B, K) int32 (-1 = none) -> (B, K, head_dim) bf16.

    Non-RoPE dims: ``bf16(fp8 * scale)`` (scale of the dim's block); RoPE dims as stored; -1, unallocated,
    slot outside ``[0, S)`` or page id outside the pool: zeros.
    """
    _check_pool(pool)
    _rows_of(indices, "indices", 2, "(B, K) int32")
    B, K = indices.shape
    dev = indices.device
    d = pool.entries_fp8.shape[-1] + pool.entries_rope.shape[-1]
    _check(indices, "indices", torch.int32, (B, K), dev)
    _check(slots, "slots", torch.int32, (B,), dev)
    _check_table(block_table, dev)
    if out is None:
        out = torch.empty((B, K, d), dtype=torch.bfloat16, device=dev)
    _check(out, "out", torch.bfloat16, (B, K, d), dev)
    if use_triton(indices):
        from ..kernels.kvcache.gather import launch_gather_entries
        launch_gather_entries(indices, slots, block_table, _flat(pool.entries_fp8).view(torch.uint8),
                              _flat(pool.entries_scale), _flat(pool.entries_rope).view(torch.int16),
                              out.view(torch.int16), entries_per_block=pool.entries_per_block)
        return out
    _record_gather_errors(pool, block_table, slots, indices)
    out.copy_(_ref().gather_entries(pool, block_table, slots, indices))
    return out


def _record_gather_errors(pool: PagedPool, block_table: torch.Tensor, slots: torch.Tensor,
                          indices: torch.Tensor) -> None:
    """Torch path: the gather kernel's error flags (megamoe/ops/errors.py), by the same rules, as device ops."""
    from ..ops import errors

    word, dev = errors.error_word(indices.device), indices.device
    num_slots, max_lb = block_table.shape
    epb, pages = pool.entries_per_block, pool.entries_fp8.shape[0]
    slot = slots.long()
    slot_ok = (slot >= 0) & (slot < num_slots)
    errors.record(word, errors.flag("gather_entries", "slots"), (slot < -1) | (slot >= num_slots))
    t = torch.where(slot_ok[:, None], indices.long(), -1)
    logical = torch.where(t >= 0, torch.div(t, epb, rounding_mode="floor"), 0)
    errors.record(word, errors.flag("gather_entries", "indices"), (t < -1) | ((t >= 0) & (logical >= max_lb)))
    if num_slots and max_lb:
        looked_up = (t >= 0) & (logical < max_lb)
        table = block_table.to(dev).long()
        page = table[torch.where(slot_ok, slot, 0)[:, None], torch.where(looked_up, logical, 0)]
        page = torch.where(looked_up, page, -1)
        errors.record(word, errors.flag("gather_entries", "block_table"), (page < -1) | (page >= pages))


def indexer_scores(pool: PagedPool, block_table: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                   slots: torch.Tensor, n_entries: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """V4 indexer scores: q (B, H, Di) bf16, weights (B, H) float32 (already including
    ``softmax_scale * H**-0.5``), n_entries (B,) int32 -> scores (B, T) float32 (written in place),
    ``sum_h w_h relu(q_h . k_t)`` for ``t < n_entries[b]``, -inf after (and for entries without storage).
    ``q`` is the model's indexer query as the official code feeds the einsum: RoPE'd, Hadamard-rotated and
    FP4-simulated."""
    return _indexer_scores(pool, block_table, q, weights, slots, n_entries, scores)


def _indexer_scores(pool: PagedPool, block_table: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                    slots: torch.Tensor, n_entries: torch.Tensor, scores: torch.Tensor, tile_max=None) -> torch.Tensor:
    """:func:`indexer_scores`; ``tile_max``: see ``megamoe.kernels.kvcache.indexer.launch_indexer_scores``."""
    _check_pool(pool)
    if pool.index_keys is None:
        raise ValueError("pool: has no indexer keys (HCA caches have no indexer)")
    _rows_of(q, "q", 3, "(B, H, Di) bf16")
    B, H, di = q.shape
    dev = q.device
    _check(q, "q", torch.bfloat16, (B, H, pool.index_keys.shape[-1] * 2), dev)
    _check(weights, "weights", torch.float32, (B, H), dev)
    _check(slots, "slots", torch.int32, (B,), dev)
    _check(n_entries, "n_entries", torch.int32, (B,), dev)
    _check_table(block_table, dev)
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores: expected a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[0] != B or not scores.is_contiguous():
        raise ValueError(f"scores: expected a contiguous (B={B}, T) float32 tensor")
    if use_triton(q):
        from ..kernels.kvcache.indexer import launch_indexer_scores
        launch_indexer_scores(q, weights, slots, n_entries, block_table, _flat(pool.index_keys),
                              _flat(pool.index_key_scale).view(torch.uint8), scores,
                              entries_per_block=pool.entries_per_block, official=pool.index_numerics == "official",
                              interpreter=interpreter_enabled(), tile_max=tile_max)
        return scores
    _record_indexer_errors(pool, block_table, slots, n_entries, scores.shape[1])
    scores.copy_(_ref().indexer_scores(pool, block_table, q, weights, slots, n_entries, scores.shape[1]))
    return scores


def _record_indexer_errors(pool: PagedPool, block_table: torch.Tensor, slots: torch.Tensor,
                           n_entries: torch.Tensor, max_entries: int) -> None:
    """Torch path: the indexer kernel's error flags (megamoe/ops/errors.py), by the same rules, as device ops."""
    from ..ops import errors

    word = errors.error_word(slots.device)
    num_slots, max_lb = block_table.shape
    epb = pool.entries_per_block
    slot = slots.long()
    slot_ok = (slot >= 0) & (slot < num_slots)
    errors.record(word, errors.flag("indexer_scores", "slots"), (slot < -1) | (slot >= num_slots))
    n = torch.where(slot_ok, n_entries.long().clamp(max=max_entries), 0)   # live entries: t < n
    errors.record(word, errors.flag("indexer_scores", "n_entries"), n > max_lb * epb)
    if num_slots and max_lb:
        lb = torch.arange(max_lb, device=slots.device)
        looked_up = lb[None, :] * epb < n[:, None]                         # table columns holding live entries
        page = torch.where(looked_up, block_table.long()[torch.where(slot_ok, slot, 0)], -1)
        errors.record(word, errors.flag("indexer_scores", "block_table"),
                      (page < -1) | (page >= pool.index_keys.shape[0]))


def indexer_topk(pool: PagedPool, block_table: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                 slots: torch.Tensor, n_entries: torch.Tensor, scores: torch.Tensor, k: int, *,
                 out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`indexer_scores` (into ``scores``, (B, T) float32) then :func:`select_topk` -> (B, min(k, T))
    int32 indices, best first (the same answer, bit for bit). On the Triton path, when the top-k plan splits
    rows over several programs (small batch), the scoring kernel also writes per-tile maxima into the top-k
    workspace so the top-k skips its row-maximum pass (one launch fewer). ``out``, ``workspace``: as
    ``megamoe.ops.topk.topk_indices`` (workspace zeroed once before first use; allocated when None)."""
    from ..ops.topk import check_k, check_workspace, topk_indices

    check_k(k)
    for name, t in (("q", q), ("scores", scores)):  # the plan below reads their metadata before indexer_scores
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not use_triton(q) or scores.dim() != 2:
        indexer_scores(pool, block_table, q, weights, slots, n_entries, scores)
        return topk_indices(scores, k, out=out, workspace=workspace)
    from ..kernels import topk as kt

    B, T = scores.shape
    interp = interpreter_enabled() and not q.is_cuda
    plan = kt.plan_for(B, T, k, interpreter=interp, num_sms=kt.DEFAULT_SMS if interp else kt._num_sms(q.device))
    if plan.path != "split":
        indexer_scores(pool, block_table, q, weights, slots, n_entries, scores)
        return topk_indices(scores, k, out=out, workspace=workspace)
    if workspace is None:
        workspace = torch.zeros((B, kt.workspace_entries(T, k, interpreter=interp, batch=B)), dtype=torch.int32,
                                device=q.device)
    else:
        check_workspace(workspace, B, T, k, q.device, interp)
    _indexer_scores(pool, block_table, q, weights, slots, n_entries, scores,
                    tile_max=workspace[:, kt.tile_maxima_offset():])
    return topk_indices(scores, k, out=out, workspace=workspace, tile_maxima=True)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) float32 -> (B, min(k, T)) int32: best first, ties to the lower index, -1 for -inf slots.

    CUDA: the one-program-per-row bucket-select kernel (``megamoe.ops.topk``, bit-identical to the reference);
    CPU: the reference (``torch.topk`` on unique int64 keys)."""
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 2:
        got = f"{scores.dtype} tensor of shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) \
            else type(scores).__name__
        raise TypeError(f"scores: expected a 2-D float32 tensor (B, T), got a {got}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected a non-negative int, got {k!r}")
    if scores.is_cuda:
        from ..ops.topk import topk_indices

        return topk_indices(scores, k)
    return _ref().select_topk(scores, k)


def swa_append(swa_rows: torch.Tensor, window: int, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               active: torch.Tensor) -> None:
    """One vectorized scatter into the sliding-window cache.

    swa_rows: (S * window + 1, D) contiguous storage (ValueError otherwise: the kernel writes rows at a stride
    of D) whose last row is a scratch row; row ``slot * window + pos % window`` receives ``kv[b]`` for active
    rows, inactive rows (and rows whose slot is outside ``[0, S)`` or whose position is negative) write the
    scratch row (no host branching). CUDA: one launch of the window-step kernel.
    Errors (``megamoe/ops/errors.py``, both backends): an active row's slot < -1 or >= S flags
    ``(swa_append, "slots")``, its position < -1 ``(swa_append, "positions")``; -1 (the "none" marker) and
    inactive rows never flag.
    """
    window_step(swa_rows, window, kv, slots, positions, active)


def _window_check(swa_rows, window, kv, slots, positions, active, window_rows, ratio, n_entries, entry_idx) -> int:
    if not isinstance(swa_rows, torch.Tensor):
        raise TypeError(f"swa_rows: expected a torch.Tensor, got {type(swa_rows).__name__}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window: expected a positive int, got {window!r}")
    if swa_rows.dim() != 2 or (swa_rows.shape[0] - 1) % window:
        raise ValueError(f"swa_rows: expected a (S * window + 1, D) tensor, got shape {tuple(swa_rows.shape)}")
    if not swa_rows.is_contiguous():  # the kernel addresses rows at a stride of D (written: no silent copy)
        raise ValueError("swa_rows: expected a contiguous tensor")
    dev = swa_rows.device
    B = _rows_of(kv, "kv", 2, "(B, D)")
    _check(kv, "kv", swa_rows.dtype, (B, swa_rows.shape[1]), dev)
    _check_batch(slots, positions, active, B, dev)
    if window_rows is not None:
        _check(window_rows, "window_rows", torch.int32, (B, window), dev)
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 0:
        raise ValueError(f"ratio: expected an int >= 0, got {ratio!r}")
    if (ratio > 0) != (n_entries is not None):
        raise ValueError("n_entries: expected a (B,) int32 tensor exactly when ratio > 0")
    if n_entries is not None:
        _check(n_entries, "n_entries", torch.int32, (B,), dev)
    if entry_idx is not None:
        if n_entries is None:
            raise ValueError("entry_idx: needs ratio > 0 and n_entries")
        if not isinstance(entry_idx, torch.Tensor):
            raise TypeError(f"entry_idx: expected a torch.Tensor, got {type(entry_idx).__name__}")
        if entry_idx.dim() != 2:
            raise ValueError(f"entry_idx: expected a (B, E) int32 tensor, got shape {tuple(entry_idx.shape)}")
        _check(entry_idx, "entry_idx", torch.int32, (B, entry_idx.shape[1]), dev)
    return B


def window_step(swa_rows: torch.Tensor, window: int, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                active: torch.Tensor, window_rows: torch.Tensor | None = None, *, ratio: int = 0,
                n_entries: torch.Tensor | None = None, entry_idx: torch.Tensor | None = None) -> None:
    """The index glue of one layer's decode step (CUDA: one launch, ``megamoe/kernels/attention_glue.py``).

    :func:`swa_append` of ``kv`` (B, D) into ``swa_rows`` (S * window + 1, D), and, written in place:
    window_rows (B, window) int32: ring rows ``slot * window + (pos - j) mod window`` of the window positions
    ``pos - j`` (j = 0..window-1; -1 where ``pos - j < 0``; the slot is not range-checked, as in the attention
    layer's formula); ratio > 0 (compressed layers): n_entries (B,) int32 ``floor((pos + 1) / ratio) * active``
    and, optionally, entry_idx (B, E) int32 ``e if e < n_entries[b] else -1`` (HCA: every stored entry).
    Same values as :func:`window_step_reference` (integer math, bit-identical). Sync-free, capturable. The
    append flags as :func:`swa_append` says (both paths).
    """
    _window_check(swa_rows, window, kv, slots, positions, active, window_rows, ratio, n_entries, entry_idx)
    if use_triton(kv):
        from ..kernels.attention_glue import launch_window_step
        launch_window_step(swa_rows, window, kv, slots, positions, active.view(torch.int8), window_rows, n_entries,
                           entry_idx, ratio=ratio)
        return
    _record_row_errors("swa_append", active, slots, positions, (swa_rows.shape[0] - 1) // window)
    window_step_reference(swa_rows, window, kv, slots, positions, active, window_rows, ratio=ratio,
                          n_entries=n_entries, entry_idx=entry_idx)


def window_step_reference(swa_rows, window, kv, slots, positions, active, window_rows=None, *, ratio=0,
                          n_entries=None, entry_idx=None) -> None:
    """The PyTorch formulas of :func:`window_step` (the CPU path, and the kernel's test reference)."""
    scratch = swa_rows.shape[0] - 1
    num_slots = scratch // window
    ok = active & (slots >= 0) & (slots < num_slots) & (positions >= 0)
    rows = slots.to(torch.int64) * window + torch.remainder(positions, window)
    rows = torch.where(ok, rows, torch.full_like(rows, scratch))
    swa_rows.index_copy_(0, rows, kv)
    if window_rows is not None:
        offsets = torch.arange(window, dtype=torch.int32, device=kv.device)
        p = positions.to(torch.int32)[:, None] - offsets[None, :]
        r = slots.to(torch.int32)[:, None] * window + torch.remainder(p, window)
        window_rows.copy_(torch.where(p >= 0, r, torch.full_like(r, -1)))
    if ratio > 0:
        n_entries.copy_(torch.div(positions + 1, ratio, rounding_mode="floor").to(torch.int32) * active)
        if entry_idx is not None:
            idx = torch.arange(entry_idx.shape[1], dtype=torch.int32, device=kv.device)[None, :].expand(
                kv.shape[0], -1)
            entry_idx.copy_(torch.where(idx < n_entries[:, None], idx, torch.full_like(idx, -1)))
