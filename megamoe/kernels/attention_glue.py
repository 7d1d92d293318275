"""Index glue of one attention layer's decode step in one launch: SWA append, window ring rows, entry counts and
the HCA entry list.

Before this kernel the decode path ran these as ~25 tiny PyTorch ops per layer (``where`` / ``remainder`` /
``index_copy_`` / ``full_like`` ...; benchmarks/count_decode_ops.py). One program per batch row:

* SWA append: ``kv[b]`` -> ring row ``slot * window + pos mod window`` of ``swa_rows`` when the row is active, its
  slot in ``[0, num_slots)`` and its position >= 0; otherwise the scratch row (the last row);
* window rows (B, window) int32: ``slot * window + (pos - j) mod window`` for ``pos - j >= 0``, else -1
  (j = 0..window-1, int32 arithmetic as the PyTorch formula: the slot is not range-checked here, the attention
  kernel masks it);
* (compressed layers) entry counts (B,) int32: ``floor((pos + 1) / ratio) * active``;
* (HCA) entry list (B, E) int32: ``e`` for ``e < n_entries[b]``, else -1.

Integer math only, so the outputs equal the PyTorch formulas bit for bit (``megamoe.kvcache.ops``'s
``window_step_reference``). Device-valued slots / positions never address memory outside the buffers (invalid rows
go to the scratch row; the other outputs are plain stores at the program's own row). Errors
(``megamoe/ops/errors.py``; active rows only, -1 is the "none" marker): a slot < -1 or >= num_slots and a position
< -1 OR ``(swa_append, "slots")`` / ``(swa_append, "positions")`` into the error word (one predicated atomic per
program; ``FLAG_* == 0``, the device guard compiled out, drops the flag code, not the masking).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Entry-list columns written per loop iteration, warps per program (tiny row kernel).
BLOCK_E = 1024
WARPS = 4


@triton.jit
def _floor_div(a, r):
    """``floor(a / r)`` for int32 ``a`` and a positive int ``r`` (whatever the rounding of ``//``)."""
    q = a // r
    return tl.where(q * r > a, q - 1, q)


@triton.jit(do_not_specialize=["num_slots"])  # an int argument of 1 would become a constexpr (a model of one slot)
def _window_step_kernel(
    kv_ptr,                        # (B, D) int16 (bf16 bits)
    slots_ptr, pos_ptr,            # (B,) int32
    active_ptr,                    # (B,) int8
    swa_ptr,                       # (S * WIN + 1, D) int16
    rows_ptr,                      # (B, WIN) int32 out (dummy without HAS_ROWS)
    n_ptr,                         # (B,) int32 out (dummy unless RATIO > 0)
    ent_ptr,                       # (B, N_ENT) int32 out (dummy unless HAS_ENTRIES)
    err_ptr,                       # (1,) int32 error word (megamoe/ops/errors.py)
    num_slots,
    D: tl.constexpr, D_P2: tl.constexpr, WIN: tl.constexpr, WIN_P2: tl.constexpr, RATIO: tl.constexpr,
    N_ENT: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_ENTRIES: tl.constexpr, BLOCK: tl.constexpr,
    FLAG_SLOTS: tl.constexpr = 0, FLAG_POSITIONS: tl.constexpr = 0,
):
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    pos = tl.load(pos_ptr + b)
    act = tl.load(active_ptr + b) != 0

    # SWA append (scratch row for invalid rows)
    ok = act & (slot >= 0) & (slot < num_slots) & (pos >= 0)
    if FLAG_SLOTS | FLAG_POSITIONS != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0)
        bad_slot = act & ((slot < -1) | (slot >= num_slots))
        bad_pos = act & (pos < -1)
        code = bad_slot.to(tl.int32) * FLAG_SLOTS | bad_pos.to(tl.int32) * FLAG_POSITIONS
        tl.atomic_or(err_ptr, code, mask=code != 0)
    dst = tl.where(ok, slot.to(tl.int64) * WIN + tl.where(ok, pos, 0) % WIN, num_slots.to(tl.int64) * WIN)
    cols = tl.arange(0, D_P2)
    cm = cols < D
    tl.store(swa_ptr + dst * D + cols, tl.load(kv_ptr + b * D + cols, mask=cm, other=0), mask=cm)

    if HAS_ROWS:
        j = tl.arange(0, WIN_P2)
        p = pos - j                                # int32, as the formula
        valid = p >= 0
        rows = slot * WIN + tl.where(valid, p, 0) % WIN
        tl.store(rows_ptr + b * WIN + j, tl.where(valid, rows, -1), mask=j < WIN)

    if RATIO > 0:
        n = _floor_div(pos + 1, RATIO) * act.to(tl.int32)
        tl.store(n_ptr + b, n)
        if HAS_ENTRIES:
            for e0 in tl.static_range(0, N_ENT, BLOCK):
                e = e0 + tl.arange(0, BLOCK)
                tl.store(ent_ptr + b * N_ENT + e, tl.where(e < n, e, -1), mask=e < N_ENT)


def launch_window_step(swa_rows: torch.Tensor, window: int, kv: torch.Tensor, slots: torch.Tensor,
                       positions: torch.Tensor, active_i8: torch.Tensor, window_rows: torch.Tensor | None,
                       n_entries: torch.Tensor | None, entry_idx: torch.Tensor | None, *, ratio: int,
                       error_word: torch.Tensor | None = None) -> None:
    """One launch for B = kv.shape[0] rows (contiguous tensors on one device).

    swa_rows: (S * window + 1, D) bf16 ring with its scratch row; kv: (B, D) bf16; slots, positions: (B,) int32;
    active_i8: (B,) int8; window_rows: (B, window) int32 or None; ratio > 0 with n_entries (B,) int32 (and
    optionally entry_idx (B, E) int32), or ratio = 0 with both None. error_word: the (1,) int32 word the
    out-of-range slots / positions of active rows flag (default: the device's, ``megamoe.ops.errors``).
    """
    from ..ops import errors

    B, D = kv.shape
    if B == 0:
        return
    num_slots = (swa_rows.shape[0] - 1) // window
    dummy = slots
    n_ent = entry_idx.shape[1] if entry_idx is not None else 0
    _window_step_kernel[(B,)](
        kv.view(torch.int16), slots, positions, active_i8, swa_rows.view(torch.int16),
        window_rows if window_rows is not None else dummy, n_entries if n_entries is not None else dummy,
        entry_idx if entry_idx is not None else dummy,
        error_word if error_word is not None else errors.error_word(kv.device), num_slots,
        FLAG_SLOTS=errors.kernel_flag("swa_append", "slots"),
        FLAG_POSITIONS=errors.kernel_flag("swa_append", "positions"), D=D, D_P2=triton.next_power_of_2(D),
        WIN=window, WIN_P2=triton.next_power_of_2(window), RATIO=ratio,
        N_ENT=n_ent, HAS_ROWS=window_rows is not None, HAS_ENTRIES=entry_idx is not None,
        BLOCK=min(BLOCK_E, triton.next_power_of_2(max(n_ent, 1))), num_warps=WARPS)


def compile_sm90(*, head_dim: int = 512, window: int = 128, ratio: int = 128, entries: int = 8192):
    """Compile the kernel for sm_90 without a GPU (default: V4-Flash HCA layer). Returns the ``CompiledKernel``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..ops import errors

    sig = dict(kv_ptr="*i16", slots_ptr="*i32", pos_ptr="*i32", active_ptr="*i8", swa_ptr="*i16", rows_ptr="*i32",
               n_ptr="*i32", ent_ptr="*i32", err_ptr="*i32", num_slots="i32")
    constexprs = dict(D=head_dim, D_P2=triton.next_power_of_2(head_dim), WIN=window,
                      WIN_P2=triton.next_power_of_2(window), RATIO=ratio, N_ENT=entries, HAS_ROWS=True,
                      HAS_ENTRIES=entries > 0, BLOCK=min(BLOCK_E, triton.next_power_of_2(max(entries, 1))),
                      FLAG_SLOTS=errors.kernel_flag("swa_append", "slots"),
                      FLAG_POSITIONS=errors.kernel_flag("swa_append", "positions"))
    sig.update({k: "constexpr" for k in constexprs})
    return triton.compile(ASTSource(_window_step_kernel, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS))
