"""Flush-write kernel: quantize compressed entries (FP8 + bf16 RoPE, optional FP4 indexer key) and scatter
them into the paged pool.

One program per batch row. Rows whose ``flush`` flag is 0, whose slot is outside ``[0, num_slots)``, whose
position is negative, or whose page is unallocated (-1) or outside ``[0, num_pages)`` store nothing (masked
stores), so the launch is the same every step. Errors (``megamoe/ops/errors.py``; only rows whose ``flush``
flag is set are checked, and -1 is the legitimate "none" marker for slots, positions and pages): a slot < -1
or >= num_slots, a position < -1 or whose entry lies past the block table, and a page id < -1 or >=
num_pages set their bit in the error word (one predicated atomic per program). Numerics (``megamoe/kvcache/config.py``):

* entries, ``OFFICIAL_ENTRY``: per 64-dim block the official ``act_quant`` (power-of-two float32 scale
  ``pow2ceil(max(amax, 1e-4) / 448)``); otherwise one ``amax / 448`` scale per entry (SCALE_COLS = 1);
* keys, ``OFFICIAL_KEY``: per 32-dim block the official ``fp4_act_quant`` (power-of-two scale stored as an
  E8M0 byte); otherwise NVFP4 (E4M3 scale per 16 dims, global scale 1.0).

Bit-exact with ``megamoe.reference.kvcache.flush_write`` on GPU and in the interpreter: divisions are
``tl.div_rn`` (exact for power-of-two scales), powers of two are built from the float32 bits, and the
E4M3/E2M1 encodes are the integer helpers of ``nvfp4_jit``.
"""
import torch
import triton
import triton.language as tl

from ..nvfp4_jit import e2m1_magnitude_code, e4m3_decode, e4m3_encode, sign_bit

#: Largest finite FP8 E4M3 value; official FP8 / FP4 amax floors (kernel ``act_quant`` / ``fp4_act_quant``).
_FP8_MAX = tl.constexpr(448.0)
_FP8_AMAX_FLOOR = tl.constexpr(1e-4)
_FP4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0 ** -126)


@triton.jit
def _is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _pow2_ceil_bits(t):
    """Biased float32 exponent (int32) of ``2 ** ceil(log2(t))`` for positive finite float32 ``t``."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _flush_write_kernel(
    entry_ptr,                    # (B, HEAD_DIM) bf16
    entry_bits_ptr,               # the same memory as int16
    key_ptr,                      # (B, KEY_DIM) bf16 (dummy without indexer)
    flush_ptr,                    # (B,) int8
    slots_ptr, positions_ptr,     # (B,) int32
    block_table_ptr,              # (S, MAX_LB) int32
    fp8_ptr,                      # (P*EPB, NOPE) uint8 view
    scale_ptr,                    # (P*EPB, SCALE_COLS) float32
    rope_ptr,                     # (P*EPB, ROPE) int16 view of bf16
    key_data_ptr,                 # (P*EPB, KEY_DIM // 2) uint8
    key_scale_ptr,                # (P*EPB, KEY_DIM // KEY_BLOCK) uint8 (E8M0 or E4M3 bytes)
    err_ptr,                      # (1,) int32 error word (megamoe/ops/errors.py)
    num_slots, max_lb, num_pages,
    RATIO: tl.constexpr, EPB: tl.constexpr,
    NOPE: tl.constexpr, ROPE: tl.constexpr, ROPE_P2: tl.constexpr,
    SCALE_COLS: tl.constexpr, COLS_P2: tl.constexpr, SB_P2: tl.constexpr, OFFICIAL_ENTRY: tl.constexpr,
    HAS_KEY: tl.constexpr, KEY_DIM: tl.constexpr, OFFICIAL_KEY: tl.constexpr,
    FLAG_SLOTS: tl.constexpr = 0, FLAG_POSITIONS: tl.constexpr = 0, FLAG_TABLE: tl.constexpr = 0,
):
    row = tl.program_id(0)
    HEAD_DIM: tl.constexpr = NOPE + ROPE
    SB: tl.constexpr = NOPE // SCALE_COLS
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(positions_ptr + row)
    wants = tl.load(flush_ptr + row) != 0
    flush = wants & (slot >= 0) & (slot < num_slots) & (pos >= 0)
    entry_index = tl.where(flush, pos, 0) // RATIO
    logical = entry_index // EPB
    page = tl.load(block_table_ptr + tl.where(flush, slot, 0) * max_lb + logical,
                   mask=flush & (logical < max_lb), other=-1)
    valid = flush & (page >= 0) & (page < num_pages)
    if FLAG_SLOTS | FLAG_POSITIONS | FLAG_TABLE != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0)
        bad_slot = wants & ((slot < -1) | (slot >= num_slots))
        bad_pos = (wants & (pos < -1)) | (flush & (logical >= max_lb))
        bad_page = (page < -1) | (page >= num_pages)
        code = bad_slot.to(tl.int32) * FLAG_SLOTS | bad_pos.to(tl.int32) * FLAG_POSITIONS \
            | bad_page.to(tl.int32) * FLAG_TABLE
        tl.atomic_or(err_ptr, code, mask=code != 0)
    dst = tl.where(valid, page, 0).to(tl.int64) * EPB + entry_index % EPB

    # FP8 half: SCALE_COLS blocks of SB dims, one float32 scale each.
    g = tl.arange(0, COLS_P2)[:, None]
    j = tl.arange(0, SB_P2)[None, :]
    nmask = (g < SCALE_COLS) & (j < SB)
    offs = g * SB + j
    x = tl.load(entry_ptr + row * HEAD_DIM + offs, mask=nmask & valid, other=0.0).to(tl.float32)
    finite = _is_finite(x)
    all_finite = tl.sum((~finite).to(tl.int32), axis=1) == 0                       # (COLS_P2,)
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
    if OFFICIAL_ENTRY:
        t = tl.maximum(amax, _FP8_AMAX_FLOOR) * (1.0 / _FP8_MAX)
        scale = (_pow2_ceil_bits(t) << 23).to(tl.float32, bitcast=True)
        divisor = scale
    else:
        scale = tl.div_rn(amax, _FP8_MAX)
        divisor = tl.where(scale > 0, scale, 1.0)
    q = tl.div_rn(x, divisor[:, None])
    mag = e4m3_encode(tl.minimum(tl.abs(q), _FP8_MAX))
    byte = mag | (sign_bit(q) << 7)
    byte = tl.where(all_finite[:, None], byte, 0)
    tl.store(fp8_ptr + dst * NOPE + offs, byte.to(tl.uint8), mask=nmask & valid)
    cols = tl.arange(0, COLS_P2)
    tl.store(scale_ptr + dst * SCALE_COLS + cols, tl.where(all_finite, scale, float("nan")),
             mask=(cols < SCALE_COLS) & valid)

    # RoPE half: bf16 bits copied as they are.
    roffs = tl.arange(0, ROPE_P2)
    rmask = roffs < ROPE
    rope_bits = tl.load(entry_bits_ptr + row * HEAD_DIM + NOPE + roffs, mask=rmask & valid, other=0)
    tl.store(rope_ptr + dst * ROPE + roffs, rope_bits, mask=rmask & valid)

    if HAS_KEY:
        # E2M1 codes, element 2i in the low nibble of byte i; KB elements (KB // 2 bytes) per scale.
        KB: tl.constexpr = 32 if OFFICIAL_KEY else 16
        GROUPS: tl.constexpr = KEY_DIM // KB
        kg = tl.arange(0, GROUPS)[:, None]
        i = tl.arange(0, KB // 2)[None, :]
        even_offs = kg * KB + 2 * i
        k_even = tl.load(key_ptr + row * KEY_DIM + even_offs, mask=valid, other=0.0).to(tl.float32)
        k_odd = tl.load(key_ptr + row * KEY_DIM + even_offs + 1, mask=valid, other=0.0).to(tl.float32)
        f_even = _is_finite(k_even)
        f_odd = _is_finite(k_odd)
        block_finite = tl.sum((~f_even).to(tl.int32) + (~f_odd).to(tl.int32), axis=1) == 0
        block_amax = tl.maximum(tl.max(tl.where(f_even, tl.abs(k_even), 0.0), axis=1),
                                tl.max(tl.where(f_odd, tl.abs(k_odd), 0.0), axis=1))
        if OFFICIAL_KEY:
            exponent = _pow2_ceil_bits(tl.maximum(block_amax, _FP4_AMAX_FLOOR) * (1.0 / 6.0))
            denom = (exponent << 23).to(tl.float32, bitcast=True)
            safe = block_finite
            scale_byte = tl.where(block_finite, exponent, 0xFF)
        else:
            scale_byte = e4m3_encode(tl.minimum(tl.div_rn(block_amax, 6.0), 448.0))
            scale_dec = e4m3_decode(scale_byte)
            safe = (scale_dec > 0) & block_finite
            denom = tl.where(safe, scale_dec, 1.0)
            scale_byte = tl.where(block_finite, scale_byte, 0x7F)
        v_even = tl.div_rn(k_even, denom[:, None])
        v_odd = tl.div_rn(k_odd, denom[:, None])
        c_even = e2m1_magnitude_code(tl.abs(v_even)) | (sign_bit(v_even) << 3)
        c_odd = e2m1_magnitude_code(tl.abs(v_odd)) | (sign_bit(v_odd) << 3)
        packed = tl.where(safe[:, None], c_even | (c_odd << 4), 0)
        tl.store(key_data_ptr + dst * (KEY_DIM // 2) + kg * (KB // 2) + i, packed.to(tl.uint8), mask=valid)
        tl.store(key_scale_ptr + dst * GROUPS + tl.arange(0, GROUPS), scale_byte.to(tl.uint8), mask=valid)


def launch_flush_write(entry, index_key, flush_i8, slots, positions, block_table, entries_fp8_u8,
                       entries_scale, entries_rope_i16, index_keys, index_key_scale_u8, *, ratio: int,
                       entries_per_block: int, official_entry: bool, official_key: bool, error_word=None):
    """entry: (B, head_dim) bf16; index_key: (B, Di) bf16 or None; flush_i8: (B,) int8;
    slots, positions: (B,) int32; block_table: (S, L) int32; pool tensors flattened over (page, slot):
    entries_fp8_u8 (P, nope) uint8, entries_scale (P, cols) f32 (cols = nope // 64 official, 1 per-entry),
    entries_rope_i16 (P, rope) int16, index_keys (P, Di // 2) uint8, index_key_scale_u8 (P, Di // 32 official
    E8M0 | Di // 16 NVFP4 E4M3) uint8 (None without indexer). error_word: the (1,) int32 word the out-of-range
    arguments of flushing rows flag (default: the device's, ``megamoe.ops.errors``)."""
    from ...ops import errors

    B = entry.shape[0]
    if B == 0:
        return
    nope = entries_fp8_u8.shape[-1]
    rope = entries_rope_i16.shape[-1]
    cols = entries_scale.shape[-1]
    has_key = index_key is not None
    key_dim = index_key.shape[-1] if has_key else 32
    if not has_key:
        index_key, index_keys, index_key_scale_u8 = entry, entries_fp8_u8, entries_fp8_u8  # never touched
    _flush_write_kernel[(B,)](
        entry, entry.view(torch.int16), index_key, flush_i8, slots, positions, block_table,
        entries_fp8_u8, entries_scale, entries_rope_i16, index_keys, index_key_scale_u8,
        error_word if error_word is not None else errors.error_word(entry.device),
        block_table.shape[0], block_table.shape[1], entries_fp8_u8.shape[0] // entries_per_block,
        RATIO=ratio, EPB=entries_per_block, NOPE=nope, ROPE=rope, ROPE_P2=triton.next_power_of_2(rope),
        SCALE_COLS=cols, COLS_P2=triton.next_power_of_2(cols), SB_P2=triton.next_power_of_2(nope // cols),
        OFFICIAL_ENTRY=official_entry, HAS_KEY=has_key, KEY_DIM=key_dim, OFFICIAL_KEY=official_key,
        FLAG_SLOTS=errors.kernel_flag("flush_write", "slots"),
        FLAG_POSITIONS=errors.kernel_flag("flush_write", "positions"),
        FLAG_TABLE=errors.kernel_flag("flush_write", "block_table"), num_warps=4,
    )
