"""Compressor step kernel: append the new token to the tail, pool on flush, rotate the streams.

One program per (batch row, BLOCK_D feature columns); a program owns its columns of its slot's state, so
the step needs no cross-program synchronisation. Rows that are inactive or do not flush are masked
inside the kernel (no host branching): one launch serves every decode step and is CUDA-graph safe. A row
whose slot is outside ``[0, num_slots)`` or whose position is negative is inactive (touches no state).
Errors (``megamoe/ops/errors.py``; only rows whose ``active`` flag is set are checked; -1 is the legitimate
"none" marker for slots and positions): a slot < -1 or >= num_slots and a position < -1 set their bit in the
error word (one predicated atomic, by the row's first column block).
Semantics: ``megamoe.reference.kvcache.compressor_step``.
"""
import triton
import triton.language as tl

#: Feature columns per program, per ratio (m): HCA's 128-slot tail tile is 128 x BLOCK_D.
_BLOCK_D = {"small_m": 128, "large_m": 32}


@triton.jit
def _compress_step_kernel(
    kv_ptr, score_ptr,            # (B, C*D) float32
    ape_ptr,                      # (M, C*D) float32 added to score at row pos % M (dummy without HAS_APE)
    slots_ptr, positions_ptr,     # (B,) int32
    active_ptr,                   # (B,) int8
    tail_k_ptr, tail_z_ptr,       # (S, M, C*D) float32
    tail_kb_ptr, tail_zb_ptr,     # (S, M, D) float32 (dummies without overlap)
    tail_len_ptr,                 # (S,) int32
    pooled_ptr,                   # (B, D) float32
    flush_ptr,                    # (B,) int8
    err_ptr,                      # (1,) int32 error word (megamoe/ops/errors.py)
    num_slots,                    # S (rows of the state)
    stride_kv, stride_z,          # row strides of kv and score (elements; unit stride along C*D)
    M: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr,
    M_P2: tl.constexpr, BLOCK_D: tl.constexpr, HAS_APE: tl.constexpr,
    FLAG_SLOTS: tl.constexpr = 0, FLAG_POSITIONS: tl.constexpr = 0,
):
    row = tl.program_id(0)
    col_block = tl.program_id(1)
    CD: tl.constexpr = (2 if OVERLAP else 1) * D
    A_OFF: tl.constexpr = D if OVERLAP else 0

    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(positions_ptr + row)
    wants = tl.load(active_ptr + row) != 0
    active = wants & (slot >= 0) & (slot < num_slots) & (pos >= 0)
    if FLAG_SLOTS | FLAG_POSITIONS != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0)
        code = (wants & ((slot < -1) | (slot >= num_slots))).to(tl.int32) * FLAG_SLOTS \
            | (wants & (pos < -1)).to(tl.int32) * FLAG_POSITIONS
        tl.atomic_or(err_ptr, code, mask=(code != 0) & (col_block == 0))
    slot = tl.where(active, slot, 0)
    cur = pos % M
    flush = active & ((pos + 1) % M == 0)
    keep = active & ((pos + 1) % M != 0)

    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    state_row = slot * (M * CD)

    # New token: stored into the tail when the row does not flush; on flush it is used from registers
    # (the a-stream is cleared below, so it never needs to reach memory).
    kv_row = kv_ptr + row.to(tl.int64) * stride_kv
    z_row = score_ptr + row.to(tl.int64) * stride_z
    new_k_a = tl.load(kv_row + A_OFF + cols, mask=cmask, other=0.0)
    new_z_a = tl.load(z_row + A_OFF + cols, mask=cmask, other=float("-inf"))
    if HAS_APE:  # the official ``score + ape[pos % m]`` (one float32 add); cur is in [0, M) for active rows
        ape_row = tl.where(active, cur, 0) * CD
        new_z_a = new_z_a + tl.load(ape_ptr + ape_row + A_OFF + cols, mask=cmask, other=0.0)
    tl.store(tail_k_ptr + state_row + cur * CD + A_OFF + cols, new_k_a, mask=cmask & keep)
    tl.store(tail_z_ptr + state_row + cur * CD + A_OFF + cols, new_z_a, mask=cmask & keep)
    if OVERLAP:
        new_k_b = tl.load(kv_row + cols, mask=cmask, other=0.0)
        new_z_b = tl.load(z_row + cols, mask=cmask, other=float("-inf"))
        if HAS_APE:
            new_z_b = new_z_b + tl.load(ape_ptr + ape_row + cols, mask=cmask, other=0.0)
        tl.store(tail_k_ptr + state_row + cur * CD + cols, new_k_b, mask=cmask & keep)
        tl.store(tail_z_ptr + state_row + cur * CD + cols, new_z_b, mask=cmask & keep)

    # Pool (flush rows only): per-feature softmax over the a-stream main half (+ b-stream).
    slots_m = tl.arange(0, M_P2)
    tile_mask = (slots_m[:, None] < M) & cmask[None, :] & flush
    is_cur = (slots_m == cur)[:, None]
    a_offs = state_row + slots_m[:, None] * CD + A_OFF + cols[None, :]
    k_a = tl.load(tail_k_ptr + a_offs, mask=tile_mask, other=0.0)
    z_a = tl.load(tail_z_ptr + a_offs, mask=tile_mask, other=float("-inf"))
    k_a = tl.where(is_cur, new_k_a[None, :], k_a)
    z_a = tl.where(is_cur, new_z_a[None, :], z_a)
    z_max = tl.max(z_a, axis=0)
    if OVERLAP:
        b_offs = slot * (M * D) + slots_m[:, None] * D + cols[None, :]
        k_b = tl.load(tail_kb_ptr + b_offs, mask=tile_mask, other=0.0)
        z_b = tl.load(tail_zb_ptr + b_offs, mask=tile_mask, other=float("-inf"))
        z_max = tl.maximum(z_max, tl.max(z_b, axis=0))
    z_ref = tl.where(z_max == float("-inf"), 0.0, z_max)
    p_a = tl.exp(z_a - z_ref[None, :])
    denom = tl.sum(p_a, axis=0)
    acc = tl.sum(p_a * k_a, axis=0)
    if OVERLAP:
        p_b = tl.exp(z_b - z_ref[None, :])
        denom += tl.sum(p_b, axis=0)
        acc += tl.sum(p_b * k_b, axis=0)
    pooled = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(pooled_ptr + row * D + cols, pooled, mask=cmask & flush)

    # Rotate (flush rows only): b <- a's overlap half, then clear the a-stream. The barrier orders every
    # thread's pooling loads of the a-stream before any thread's clearing stores.
    tl.debug_barrier()
    if OVERLAP:
        ov_offs = state_row + slots_m[:, None] * CD + cols[None, :]
        k_ov = tl.load(tail_k_ptr + ov_offs, mask=tile_mask, other=0.0)
        z_ov = tl.load(tail_z_ptr + ov_offs, mask=tile_mask, other=float("-inf"))
        k_ov = tl.where(is_cur, new_k_b[None, :], k_ov)
        z_ov = tl.where(is_cur, new_z_b[None, :], z_ov)
        tl.store(tail_kb_ptr + b_offs, k_ov, mask=tile_mask)
        tl.store(tail_zb_ptr + b_offs, z_ov, mask=tile_mask)
        tl.debug_barrier()
        tl.store(tail_k_ptr + ov_offs, tl.zeros_like(k_ov), mask=tile_mask)
        tl.store(tail_z_ptr + ov_offs, tl.full(z_ov.shape, float("-inf"), tl.float32), mask=tile_mask)
    tl.store(tail_k_ptr + a_offs, tl.zeros_like(k_a), mask=tile_mask)
    tl.store(tail_z_ptr + a_offs, tl.full(z_a.shape, float("-inf"), tl.float32), mask=tile_mask)

    first = col_block == 0
    tl.store(tail_len_ptr + slot, tl.where(flush, 0, cur + 1), mask=active & first)
    tl.store(flush_ptr + row, flush.to(tl.int8), mask=first)


def launch_compress_step(kv, score, slots, positions, active_i8, tail_k, tail_z, tail_kb, tail_zb, tail_len,
                         pooled, flush_i8, *, ratio: int, width: int, overlap: bool, ape=None, error_word=None):
    """Launch the compressor step for B = kv.shape[0] rows (all tensors on one device, contiguous except kv and
    score, whose rows may be strided).

    kv, score: (B, C*width) float32 with unit stride along C*width (column views of the layer's fused compressor
    projection output are read in place); slots, positions: (B,) int32; active_i8: (B,) int8;
    tail_*: the :class:`~megamoe.kvcache.state.CompressorState` tensors; pooled: (B, width) float32;
    flush_i8: (B,) int8 output; ape: (ratio, C*width) float32 or None, added to score at row ``pos % ratio``.
    error_word: the (1,) int32 word the out-of-range arguments of active rows flag (default: the device's,
    ``megamoe.ops.errors``).
    """
    from ...ops import errors

    B = kv.shape[0]
    if B == 0:
        return
    block_d = _BLOCK_D["small_m" if ratio <= 16 else "large_m"]
    block_d = min(block_d, triton.next_power_of_2(width))
    if not overlap:
        tail_kb, tail_zb = tail_k, tail_z  # never read
    grid = (B, triton.cdiv(width, block_d))
    _compress_step_kernel[grid](
        kv, score, ape if ape is not None else score, slots, positions, active_i8, tail_k, tail_z, tail_kb, tail_zb,
        tail_len, pooled, flush_i8,
        error_word if error_word is not None else errors.error_word(kv.device),
        tail_len.shape[0], kv.stride(0), score.stride(0),
        M=ratio, D=width, OVERLAP=overlap, M_P2=triton.next_power_of_2(ratio), BLOCK_D=block_d,
        HAS_APE=ape is not None, FLAG_SLOTS=errors.kernel_flag("compressor_step", "slots"),
        FLAG_POSITIONS=errors.kernel_flag("compressor_step", "positions"),
    )
