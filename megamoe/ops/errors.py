"""Device-side error word: out-of-range device indices are masked *and* reported, without host syncs.

Every kernel (and torch path) that takes device-valued indices drops the invalid ones (never reads or writes
outside its tensors) and ORs a flag bit into a per-device int32 *error word*. Nothing is read on the host on
the hot path; :func:`check_errors` reads and clears the word later (outside CUDA-graph capture) and raises
:class:`DeviceIndexError` naming the op and the argument of every bit that is set.

* :func:`error_word` -- the (1,) int32 word of a device, allocated once per device and cached in
  ``_WORDS`` (keyed by the resolved ``torch.device``; the cached tensor lives as long as the process, so a
  captured CUDA graph may keep its address). Allocate it before capturing a graph: a first call while the
  stream is capturing raises (a zero-fill recorded in a graph would clear the word on every replay).
* :data:`FLAGS` -- ``{(op, argument): bit}``; :func:`flag` looks one up.
* :func:`record` -- the torch/CPU paths' way to set a flag: ``word |= flag * any(invalid)`` (device ops).
* :func:`check_errors` / :func:`peek_errors` / :func:`clear_errors`; :func:`check_errors_eager` is what the
  layers call after an eager forward: a no-op while capturing, when eager checks are off
  (:func:`set_eager_checks`), or on CUDA when ``torch.cuda.set_sync_debug_mode`` is not 0 (the caller asked
  for a sync-free run; call :func:`check_errors` yourself there). ``capture()`` users call
  :func:`check_errors` between replays.

Drop rules (identical on every backend, see each op's docstring): grouped GEMM ``row_index`` outside
``[0, S)`` -> that row's activations read as zeros; combine ``inv_perm`` outside ``[0, R)`` -> the pair adds
nothing; dispatch ``topk_ids`` outside ``[0, E)`` -> the pair goes to the padding rows after
``expert_offsets[E-1]`` (computed as zeros); kvcache gather / sparse attention: ``-1`` is the legitimate "no
entry" marker and is not an error, any other out-of-range index / slot / page id is skipped and flagged
(sparse attention flags a slot only when the query has entry ids, K > 0); RoPE ops (q_kv_path / index_q_path /
output_path) position outside ``[0, n_positions)`` -> the rotation is the complex 0 (zero RoPE dims), post_pool
window start past the table -> clamped to the last row; swa_append bad slot / position of an active row -> the
scratch row.

Kernels that take device-valued indices (audit for issue 12):

* mask AND flag: grouped GEMMs ``row_index`` (nvfp4_gemm, nvfp4_gemv, nvfp4_mma_decode, nvfp4_wgmma);
  moe_combine ``inv_perm``; moe_dispatch ``topk_ids``; kvcache_gather ``indices`` / ``slots`` /
  ``block_table``; sparse_attention ``window_idx`` / ``entry_idx`` / ``slots`` / ``block_table``;
  kvcache_flush (``flush_write``: ``slots`` / ``positions`` (< -1, or the entry past the block table) /
  ``block_table``, flushing rows only: the write is dropped); kvcache_compress (``compressor_step``:
  ``slots`` / ``positions`` < -1, active rows only: the row is inactive); indexer (``indexer_scores``:
  ``slots``, ``n_entries`` (a live entry past the block table), ``block_table``: the entry scores -inf, so
  top-k never selects it and the later gather / attention sees -1); moe_router hash routing (``route``:
  ``token_ids`` outside ``[0, vocab)``, ``tid2eid`` entries outside ``[0, E)`` of a valid token's row: ids
  0..k-1 and NaN weights); v4_elementwise RoPE (``q_kv_path`` / ``index_q_path`` / ``output_path``:
  ``positions`` outside ``[0, n_positions)``, -1 included (every row is computed, no marker): the token's RoPE
  dims are rotated by 0, i.e. zeros; ``post_pool``: ``positions + shift >= n_positions``, the row clamped, a
  window start below 0 is legitimate); swa_append (``window_step``'s append: ``slots`` < -1 / >= S,
  ``positions`` < -1, active rows only: the scratch row). Slot / position / page -1 and inactive (non-active /
  non-flushing) rows are the documented "none" markers and never flag.
* cannot go out of bounds by construction: topk (reads scores; its candidate / selection indices are its own
  workspace, produced in-kernel), sampling (its token ids come from the sort it runs itself), quantize,
  hyper_connection, nvfp4_splitk (dense, no index input).

The guard can be compiled out for benchmarking only (:data:`DEVICE_GUARD`, ``MEGAMOE_DEVICE_GUARD=0``; the
MoE-path kernels and sparse attention drop their masking and flag code; the router's hash path, kvcache_flush,
kvcache_compress, the indexer, the v4_elementwise RoPE kernels and the window-step kernel drop only their flag
code; see benchmarks/bench_guard.py).
"""
from __future__ import annotations

import os

import torch

FLAGS: dict[tuple[str, str], int] = {
    ("nvfp4_grouped_mm", "row_index"): 1 << 0,
    ("combine", "inv_perm"): 1 << 1,
    ("dispatch", "topk_ids"): 1 << 2,
    ("gather_entries", "indices"): 1 << 3,
    ("gather_entries", "slots"): 1 << 4,
    ("gather_entries", "block_table"): 1 << 5,
    ("sparse_attention", "window_idx"): 1 << 6,
    ("sparse_attention", "entry_idx"): 1 << 7,
    ("sparse_attention", "slots"): 1 << 8,
    ("sparse_attention", "block_table"): 1 << 9,
    ("flush_write", "slots"): 1 << 10,
    ("flush_write", "positions"): 1 << 11,
    ("flush_write", "block_table"): 1 << 12,
    ("compressor_step", "slots"): 1 << 13,
    ("compressor_step", "positions"): 1 << 14,
    ("indexer_scores", "slots"): 1 << 15,
    ("indexer_scores", "n_entries"): 1 << 16,
    ("indexer_scores", "block_table"): 1 << 17,
    ("route", "token_ids"): 1 << 18,
    ("route", "tid2eid"): 1 << 19,
    ("q_kv_path", "positions"): 1 << 20,
    ("index_q_path", "positions"): 1 << 21,
    ("output_path", "positions"): 1 << 22,
    ("post_pool", "positions"): 1 << 23,
    ("swa_append", "slots"): 1 << 24,
    ("swa_append", "positions"): 1 << 25,
}

# Benchmarking switch only (never for serving): MEGAMOE_DEVICE_GUARD=0 in the environment, read once at import,
# compiles the kernels' masking of out-of-range device indices and their flag code out (kernel_flag() returns 0
# and the kernels drop both under that constexpr), to measure what the guard costs (benchmarks/bench_guard.py).
# An out-of-range index then reads / writes out of bounds. The torch paths are unaffected.
DEVICE_GUARD: bool = os.environ.get("MEGAMOE_DEVICE_GUARD", "1").strip() != "0"

_WORDS: dict[torch.device, torch.Tensor] = {}
_EAGER_CHECKS = True


class DeviceIndexError(ValueError):
    """Raised by :func:`check_errors`; ``.flags`` holds the (op, argument) pairs that were reported."""

    def __init__(self, flags: list[tuple[str, str]], device: torch.device):
        self.flags = flags
        names = ", ".join(f"{op}: argument {arg!r}" for op, arg in flags)
        super().__init__(f"out-of-range device indices were masked (dropped) on {device}: {names}")


def flag(op: str, argument: str) -> int:
    """The bit of ``(op, argument)`` in the error word."""
    return FLAGS[(op, argument)]


def kernel_flag(op: str, argument: str) -> int:
    """The constexpr flag a kernel launcher passes: :func:`flag`, or 0 when the device guard is compiled out
    (:data:`DEVICE_GUARD` False); a kernel given 0 neither masks nor flags that argument."""
    return FLAGS[(op, argument)] if DEVICE_GUARD else 0


def _resolve(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def error_word(device) -> torch.Tensor:
    """The (1,) int32 error word of ``device`` (zeros when created; one tensor per device, cached)."""
    device = _resolve(device)
    word = _WORDS.get(device)
    if word is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"error_word: the error word of {device} must be allocated before CUDA-graph "
                               f"capture; call megamoe.ops.errors.error_word({str(device)!r}) first")
        word = torch.zeros(1, dtype=torch.int32, device=device)
        _WORDS[device] = word
    return word


def record(word: torch.Tensor, bit: int, invalid: torch.Tensor) -> None:
    """``word |= bit`` where any element of the bool tensor ``invalid`` is set (device ops, no sync)."""
    if invalid.numel() == 0:
        return
    word.bitwise_or_(invalid.any().to(torch.int32) * bit)


def decode(value: int) -> list[tuple[str, str]]:
    """The (op, argument) pairs whose bits are set in ``value``."""
    return [key for key, bit in FLAGS.items() if value & bit]


def peek_errors(device) -> int:
    """The current value of the word (host read: syncs with the device)."""
    return int(error_word(device).item())


def clear_errors(device) -> None:
    error_word(device).zero_()


def check_errors(device=None) -> None:
    """Read and clear the error word(s); raise :class:`DeviceIndexError` naming every reported (op, argument).

    device: one device, or None for every device whose word exists. Syncs with the device: call it outside
    CUDA-graph capture (it raises RuntimeError while the current stream is capturing).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("check_errors: called while a CUDA graph is being captured; call it between replays")
    devices = [_resolve(device)] if device is not None else list(_WORDS)
    for dev in devices:
        word = error_word(dev)
        value = int(word.item())
        if value:
            word.zero_()
            raise DeviceIndexError(decode(value), dev)


def set_eager_checks(enabled: bool) -> bool:
    """Turn the layers' post-forward :func:`check_errors_eager` on or off; returns the previous setting."""
    global _EAGER_CHECKS
    previous, _EAGER_CHECKS = _EAGER_CHECKS, bool(enabled)
    return previous


def check_errors_eager(device) -> None:
    """:func:`check_errors` for eager layer calls; skipped while capturing, when disabled, or (CUDA) when the
    sync debug mode is set (the caller asked for no syncs)."""
    if not _EAGER_CHECKS:
        return
    device = _resolve(device)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
            return
    check_errors(device)
