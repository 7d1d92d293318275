"""Dequantizing reader: gather selected compressed entries from the paged pool back to bf16.

``out[b, j] = [bf16(fp8 * scale), rope]`` of entry ``indices[b, j]`` of slot ``slots[b]``, where non-RoPE
dim ``n`` uses scale column ``n // (nope // SCALE_COLS)`` (SCALE_COLS = nope // 64 for the official
numerics, 1 for one scale per entry). Index -1, a slot outside ``[0, num_slots)``, an unallocated page or a
page id outside ``[0, num_pages)`` gives zeros (nothing is read). One program per (row, BLOCK_K selected
entries). Bit-exact with ``megamoe.reference.kvcache.gather_entries`` (integer E4M3 decode, integer bf16
round-to-nearest-even).

Errors (``megamoe/ops/errors.py``; -1 is the legitimate "none" marker for indices, slots and pages and is
never an error): an index < -1 or past the block table, a slot < -1 or >= num_slots, and a block-table page
id < -1 or >= num_pages set their bit in the error word with one predicated atomic per program.
"""
import triton
import triton.language as tl

from ..nvfp4_jit import e4m3_decode

BLOCK_K = 16


@triton.jit
def _bf16_bits_rne(v):
    """float32 -> bf16 bit pattern (int16), round to nearest even; NaN -> 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, 0x7FC0, rounded)
    return rounded.to(tl.int16)


@triton.jit
def _gather_entries_kernel(
    indices_ptr,                  # (B, K) int32
    slots_ptr,                    # (B,) int32
    block_table_ptr,              # (S, MAX_LB) int32
    fp8_ptr,                      # (P*EPB, NOPE) uint8
    scale_ptr,                    # (P*EPB, SCALE_COLS) float32
    rope_ptr,                     # (P*EPB, ROPE) int16
    out_ptr,                      # (B, K, NOPE + ROPE) int16 view of bf16
    err_ptr,                      # (1,) int32 error word
    K, num_slots, max_lb, num_pages,
    EPB: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, SCALE_COLS: tl.constexpr,
    NOPE_P2: tl.constexpr, ROPE_P2: tl.constexpr, BLOCK: tl.constexpr,
    FLAG_INDICES: tl.constexpr, FLAG_SLOTS: tl.constexpr, FLAG_TABLE: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jmask = j < K
    HEAD_DIM: tl.constexpr = NOPE + ROPE
    SB: tl.constexpr = NOPE // SCALE_COLS
    slot = tl.load(slots_ptr + row).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    t = tl.load(indices_ptr + row * K + j, mask=jmask, other=-1)
    t = tl.where(slot_ok, t, -1)
    logical = tl.where(t >= 0, t // EPB, 0)
    page = tl.load(block_table_ptr + tl.where(slot_ok, slot, 0) * max_lb + logical,
                   mask=(t >= 0) & (logical < max_lb), other=-1)
    valid = (t >= 0) & (page >= 0) & (page < num_pages)
    bad_index = tl.max(((t < -1) | ((t >= 0) & (logical >= max_lb))).to(tl.int32), 0)
    bad_page = tl.max(((page < -1) | (page >= num_pages)).to(tl.int32), 0)
    bad_slot = ((slot < -1) | (slot >= num_slots)) & (tl.program_id(1) == 0)
    code = bad_index * FLAG_INDICES | bad_page * FLAG_TABLE | bad_slot.to(tl.int32) * FLAG_SLOTS
    tl.atomic_or(err_ptr, code, mask=code != 0)
    src = tl.where(valid, page, 0).to(tl.int64) * EPB + tl.where(t >= 0, t % EPB, 0)

    n = tl.arange(0, NOPE_P2)[None, :]
    nmask = (n < NOPE) & valid[:, None]
    code = tl.load(fp8_ptr + src[:, None] * NOPE + n, mask=nmask, other=0)
    scale = tl.load(scale_ptr + src[:, None] * SCALE_COLS + n // SB, mask=nmask, other=0.0)
    value = e4m3_decode(code) * scale
    bits = tl.where(nmask, _bf16_bits_rne(value), 0).to(tl.int16)
    out_row = (row * K + j).to(tl.int64) * HEAD_DIM
    tl.store(out_ptr + out_row[:, None] + n, bits, mask=(n < NOPE) & jmask[:, None])

    r = tl.arange(0, ROPE_P2)[None, :]
    rmask = (r < ROPE) & valid[:, None]
    rope = tl.load(rope_ptr + src[:, None] * ROPE + r, mask=rmask, other=0)
    tl.store(out_ptr + out_row[:, None] + NOPE + r, rope, mask=(r < ROPE) & jmask[:, None])


def launch_gather_entries(indices, slots, block_table, entries_fp8_u8, entries_scale, entries_rope_i16, out_i16,
                          *, entries_per_block: int, error_word=None):
    """indices: (B, K) int32; slots: (B,) int32; block_table: (S, L) int32; pool tensors flattened over
    (page, slot): entries_fp8_u8 (P, nope) uint8, entries_scale (P, cols) float32, entries_rope_i16 (P, rope)
    int16; out_i16: (B, K, head_dim) int16 view of the bf16 output. error_word: the (1,) int32 word the
    out-of-range arguments flag (default: the device's, ``megamoe.ops.errors``)."""
    from ...ops import errors

    B, K = indices.shape
    if B == 0 or K == 0:
        return
    nope = entries_fp8_u8.shape[-1]
    rope = entries_rope_i16.shape[-1]
    grid = (B, triton.cdiv(K, BLOCK_K))
    _gather_entries_kernel[grid](
        indices, slots, block_table, entries_fp8_u8, entries_scale, entries_rope_i16, out_i16,
        error_word if error_word is not None else errors.error_word(indices.device),
        K, block_table.shape[0], block_table.shape[1], entries_fp8_u8.shape[0] // entries_per_block,
        EPB=entries_per_block, NOPE=nope, ROPE=rope, SCALE_COLS=entries_scale.shape[-1],
        NOPE_P2=triton.next_power_of_2(nope), ROPE_P2=triton.next_power_of_2(rope), BLOCK=BLOCK_K,
        FLAG_INDICES=errors.flag("gather_entries", "indices"), FLAG_SLOTS=errors.flag("gather_entries", "slots"),
        FLAG_TABLE=errors.flag("gather_entries", "block_table"),
    )
