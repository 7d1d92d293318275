"""Flush-write kernel: quantize compressed entries (FP8 + bf16 RoPE, optional NVFP4 indexer key) and
scatter them into the paged pool.

One program per batch row. Rows whose ``flush`` flag is 0, or whose page is unallocated (-1), store
nothing (masked stores), so the launch is the same every step. Bit-exact with
``megamoe.reference.kvcache.flush_write`` on GPU and in the interpreter: divisions are ``tl.div_rn`` and
FP8/E4M3/E2M1 encodes are the integer helpers of ``nvfp4_jit``.
"""
import torch
import triton
import triton.language as tl

from .nvfp4_jit import e2m1_magnitude_code, e4m3_decode, e4m3_encode, sign_bit


@triton.jit
def _is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _flush_write_kernel(
    entry_ptr,                    # (B, HEAD_DIM) bf16
    entry_bits_ptr,               # the same memory as int16
    key_ptr,                      # (B, KEY_DIM) bf16 (dummy without indexer)
    flush_ptr,                    # (B,) int8
    slots_ptr, positions_ptr,     # (B,) int32
    block_table_ptr,              # (S, MAX_LB) int32
    fp8_ptr,                      # (NB*EPB, NOPE) uint8 view
    scale_ptr,                    # (NB*EPB,) float32
    rope_ptr,                     # (NB*EPB, ROPE) int16 view of bf16
    key_data_ptr,                 # (NB*EPB, KEY_DIM // 2) uint8
    key_scale_ptr,                # (NB*EPB, KEY_DIM // 16) uint8 view
    max_lb,
    RATIO: tl.constexpr, EPB: tl.constexpr,
    NOPE: tl.constexpr, ROPE: tl.constexpr, NOPE_P2: tl.constexpr, ROPE_P2: tl.constexpr,
    HAS_KEY: tl.constexpr, KEY_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    HEAD_DIM: tl.constexpr = NOPE + ROPE
    flush = tl.load(flush_ptr + row) != 0
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(positions_ptr + row)
    entry_index = pos // RATIO
    logical = entry_index // EPB
    page = tl.load(block_table_ptr + slot * max_lb + logical, mask=flush & (logical < max_lb), other=-1)
    valid = flush & (page >= 0)
    dst = page.to(tl.int64) * EPB + entry_index % EPB

    # FP8 half: one float32 scale per entry.
    offs = tl.arange(0, NOPE_P2)
    nmask = offs < NOPE
    x = tl.load(entry_ptr + row * HEAD_DIM + offs, mask=nmask & valid, other=0.0).to(tl.float32)
    finite = _is_finite(x)
    all_finite = tl.sum((~finite).to(tl.int32), axis=0) == 0
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=0)
    scale = tl.div_rn(amax, 448.0)
    divisor = tl.where(scale > 0, scale, 1.0)
    q = tl.div_rn(x, divisor)
    mag = e4m3_encode(tl.minimum(tl.abs(q), 448.0))
    byte = mag | (sign_bit(q) << 7)
    byte = tl.where(all_finite, byte, 0)
    tl.store(fp8_ptr + dst * NOPE + offs, byte.to(tl.uint8), mask=nmask & valid)
    tl.store(scale_ptr + dst, tl.where(all_finite, scale, float("nan")), mask=valid)

    # RoPE half: bf16 bits copied as they are.
    roffs = tl.arange(0, ROPE_P2)
    rmask = roffs < ROPE
    rope_bits = tl.load(entry_bits_ptr + row * HEAD_DIM + NOPE + roffs, mask=rmask & valid, other=0)
    tl.store(rope_ptr + dst * ROPE + roffs, rope_bits, mask=rmask & valid)

    if HAS_KEY:
        # NVFP4 key, global scale 1.0: element 2i in the low nibble of byte i; 16 elements per E4M3 scale.
        GROUPS: tl.constexpr = KEY_DIM // 16
        g = tl.arange(0, GROUPS)[:, None]
        i = tl.arange(0, 8)[None, :]
        even_offs = g * 16 + 2 * i
        k_even = tl.load(key_ptr + row * KEY_DIM + even_offs, mask=valid, other=0.0).to(tl.float32)
        k_odd = tl.load(key_ptr + row * KEY_DIM + even_offs + 1, mask=valid, other=0.0).to(tl.float32)
        f_even = _is_finite(k_even)
        f_odd = _is_finite(k_odd)
        block_finite = tl.sum((~f_even).to(tl.int32) + (~f_odd).to(tl.int32), axis=1) == 0
        block_amax = tl.maximum(tl.max(tl.where(f_even, tl.abs(k_even), 0.0), axis=1),
                                tl.max(tl.where(f_odd, tl.abs(k_odd), 0.0), axis=1))
        scale_byte = e4m3_encode(tl.minimum(tl.div_rn(block_amax, 6.0), 448.0))
        scale_dec = e4m3_decode(scale_byte)
        safe = (scale_dec > 0) & block_finite
        denom = tl.where(safe, scale_dec, 1.0)[:, None]
        v_even = tl.div_rn(k_even, denom)
        v_odd = tl.div_rn(k_odd, denom)
        c_even = e2m1_magnitude_code(tl.abs(v_even)) | (sign_bit(v_even) << 3)
        c_odd = e2m1_magnitude_code(tl.abs(v_odd)) | (sign_bit(v_odd) << 3)
        packed = tl.where(safe[:, None], c_even | (c_odd << 4), 0)
        tl.store(key_data_ptr + dst * (KEY_DIM // 2) + g * 8 + i, packed.to(tl.uint8), mask=valid)
        scale_byte = tl.where(block_finite, scale_byte, 0x7F)
        tl.store(key_scale_ptr + dst * GROUPS + tl.arange(0, GROUPS), scale_byte.to(tl.uint8), mask=valid)


def launch_flush_write(entry, index_key, flush_i8, slots, positions, block_table, entries_fp8_u8,
                       entries_scale, entries_rope_i16, index_keys, index_key_scale_u8, *, ratio: int,
                       entries_per_block: int):
    """entry: (B, head_dim) bf16; index_key: (B, Di) bf16 or None; flush_i8: (B,) int8;
    slots, positions: (B,) int32; block_table: (S, L) int32; pool tensors flattened over (page, slot):
    entries_fp8_u8 (P, nope) uint8, entries_scale (P,) f32, entries_rope_i16 (P, rope) int16,
    index_keys (P, Di // 2) uint8, index_key_scale_u8 (P, Di // 16) uint8 (None without indexer)."""
    B = entry.shape[0]
    if B == 0:
        return
    nope = entries_fp8_u8.shape[-1]
    rope = entries_rope_i16.shape[-1]
    has_key = index_key is not None
    key_dim = index_key.shape[-1] if has_key else 32
    if not has_key:
        index_key, index_keys, index_key_scale_u8 = entry, entries_fp8_u8, entries_fp8_u8  # never touched
    _flush_write_kernel[(B,)](
        entry, entry.view(torch.int16), index_key, flush_i8, slots, positions, block_table,
        entries_fp8_u8, entries_scale, entries_rope_i16, index_keys, index_key_scale_u8,
        block_table.shape[1],
        RATIO=ratio, EPB=entries_per_block, NOPE=nope, ROPE=rope,
        NOPE_P2=triton.next_power_of_2(nope), ROPE_P2=triton.next_power_of_2(rope),
        HAS_KEY=has_key, KEY_DIM=key_dim, num_warps=4,
    )
