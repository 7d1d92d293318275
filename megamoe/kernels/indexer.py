"""Indexer scoring kernel: V4 lightning-indexer scores of one query per request over its FP4 keys.

``scores[b, t] = sum_h weights[b, h] * relu(q[b, h] . key_t)`` for ``t < n_entries[b]``, ``-inf`` for
``n_entries[b] <= t < max_entries`` and for entries without storage (slot outside ``[0, num_slots)``,
unallocated page, page id outside ``[0, num_pages)``). Keys are read from the paged pool through the block
table and decoded in-kernel; products accumulate in float32. Even and odd key elements (the low and high
nibbles) are multiplied with the even and odd query dims separately, so the packed bytes never need
interleaving. One program per (row, BLOCK_T entries). Reference: ``megamoe.reference.kvcache.indexer_scores``
(float64; agreement to float32 summation order).

* ``OFFICIAL`` (E2M1 + E8M0 power-of-two scale per 32 dims): one K = 16 dot pair per 32-dim block on the
  unscaled codes (exact in bf16), then ``partial * scale`` in float32, so any E8M0 scale is exact.
* NVFP4 (E4M3 scale per 16 dims): E2M1 code * E4M3 scale is exact in bf16 (<= 2 + 4 significant bits), so
  the scaled key goes into one full-width dot.

The FP4 -> bf16 decode is the GEMM kernels' (``nvfp4_gemm``: keys come out as ``k * 2**-8``, undone on the
scores).
"""
import triton
import triton.language as tl

from .nvfp4_jit import decode_e2m1_pairs_portable, decode_e2m1_pairs_sm90, e4m3_scale_factor_2p118

#: Entries per program (GPU, interpreter).
BLOCK_T = {"gpu": 128, "interpreter": 16}


@triton.jit
def _indexer_scores_kernel(
    q_ptr,                        # (B, H, KEY_DIM) bf16
    weights_ptr,                  # (B, H) float32
    slots_ptr, n_entries_ptr,     # (B,) int32
    block_table_ptr,              # (S, MAX_LB) int32
    key_data_ptr,                 # (P, KEY_DIM // 2) uint8
    key_scale_ptr,                # (P, KEY_DIM // 32) uint8 E8M0 (OFFICIAL) | (P, KEY_DIM // 16) uint8 E4M3
    scores_ptr,                   # (B, max_entries) float32
    max_entries, num_slots, max_lb, num_pages,
    H: tl.constexpr, KEY_DIM: tl.constexpr, EPB: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr, OFFICIAL: tl.constexpr,
):
    row = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    HALF: tl.constexpr = KEY_DIM // 2
    slot = tl.load(slots_ptr + row).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    n = tl.load(n_entries_ptr + row)
    live = (t < tl.minimum(n, max_entries)) & slot_ok
    page = tl.load(block_table_ptr + tl.where(slot_ok, slot, 0) * max_lb + t // EPB,
                   mask=live & (t // EPB < max_lb), other=-1)
    live = live & (page >= 0) & (page < num_pages)
    src = tl.where(live, page, 0).to(tl.int64) * EPB + t % EPB
    h = tl.arange(0, H)[:, None]
    q_row = q_ptr + row * (H * KEY_DIM) + h * KEY_DIM

    if OFFICIAL:
        # per 32-dim block: 16 bytes of codes, one E8M0 scale applied to the block's partial dot
        GROUPS32: tl.constexpr = KEY_DIM // 32
        i16 = tl.arange(0, 16)[None, :]
        unit = tl.full((BLOCK, 16), 2.0 ** 118, tl.float32)       # scale 1 in the decode's 2**118 convention
        logits = tl.zeros((BLOCK, H), dtype=tl.float32)
        for g in tl.static_range(GROUPS32):
            packed = tl.load(key_data_ptr + src[:, None] * HALF + g * 16 + i16, mask=live[:, None], other=0)
            q_even = tl.load(q_row + g * 32 + 2 * i16)
            q_odd = tl.load(q_row + g * 32 + 2 * i16 + 1)
            if INTERPRET:
                k_even, k_odd = decode_e2m1_pairs_portable(packed, unit)
                part = (tl.dot(k_even.to(tl.float32), tl.trans(q_even.to(tl.float32)))
                        + tl.dot(k_odd.to(tl.float32), tl.trans(q_odd.to(tl.float32))))
            else:
                k_even, k_odd = decode_e2m1_pairs_sm90(packed, unit)
                part = tl.dot(k_even, tl.trans(q_even))
                part = tl.dot(k_odd, tl.trans(q_odd), part)
            sbyte = tl.load(key_scale_ptr + src * GROUPS32 + g, mask=live, other=0).to(tl.int32)
            scale = (sbyte << 23).to(tl.float32, bitcast=True)
            scale = tl.where(sbyte == 0xFF, float("nan"), scale)
            logits += (part * 256.0) * scale[:, None]
        w = tl.load(weights_ptr + row * H + tl.arange(0, H))
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
    else:
        i = tl.arange(0, HALF)[None, :]
        GROUPS: tl.constexpr = KEY_DIM // 16
        packed = tl.load(key_data_ptr + src[:, None] * HALF + i, mask=live[:, None], other=0)
        # one E4M3 decode per 16-element group (as scale * 2**118), broadcast over the group's 8 bytes
        scale_code = tl.load(key_scale_ptr + src[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :],
                             mask=live[:, None], other=0).to(tl.int32)
        factor = tl.reshape(tl.broadcast_to(e4m3_scale_factor_2p118(scale_code)[:, :, None], (BLOCK, GROUPS, 8)),
                            (BLOCK, HALF))
        # exact bf16 keys * 2**-8 (the GEMM's FP4 decode: inline asm on the GPU, integer bit patterns in the
        # interpreter); the 2**8 goes back onto the scores below (a power of two: same rounding)
        if INTERPRET:
            k_even, k_odd = decode_e2m1_pairs_portable(packed, factor)
        else:
            k_even, k_odd = decode_e2m1_pairs_sm90(packed, factor)

        q_even = tl.load(q_row + 2 * i)
        q_odd = tl.load(q_row + 2 * i + 1)
        if INTERPRET:  # the interpreter's bf16 dot is wrong; the bf16 values are exact in float32
            logits = (tl.dot(k_even.to(tl.float32), tl.trans(q_even.to(tl.float32)))
                      + tl.dot(k_odd.to(tl.float32), tl.trans(q_odd.to(tl.float32))))
        else:
            logits = tl.dot(k_even, tl.trans(q_even)) + tl.dot(k_odd, tl.trans(q_odd))   # (BLOCK, H) float32
        w = tl.load(weights_ptr + row * H + tl.arange(0, H))
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * 256.0
    score = tl.where(live, score, float("-inf"))
    tl.store(scores_ptr + row.to(tl.int64) * max_entries + t, score, mask=t < max_entries)


def launch_indexer_scores(q, weights, slots, n_entries, block_table, index_keys, index_key_scale_u8, scores,
                          *, entries_per_block: int, official: bool, interpreter: bool = False):
    """q: (B, H, Di) bf16 contiguous; weights: (B, H) float32; slots, n_entries: (B,) int32;
    block_table: (S, L) int32; index_keys: (P*EPB, Di // 2) uint8; index_key_scale_u8: (P*EPB, Di // 32)
    E8M0 (official) or (P*EPB, Di // 16) E4M3 bytes; scores: (B, max_entries) float32 output."""
    B, H, key_dim = q.shape
    max_entries = scores.shape[1]
    if B == 0 or max_entries == 0:
        return
    block = BLOCK_T["interpreter" if interpreter else "gpu"]
    grid = (B, triton.cdiv(max_entries, block))
    _indexer_scores_kernel[grid](
        q, weights, slots, n_entries, block_table, index_keys, index_key_scale_u8, scores,
        max_entries, block_table.shape[0], block_table.shape[1], index_keys.shape[0] // entries_per_block,
        H=H, KEY_DIM=key_dim, EPB=entries_per_block, BLOCK=block, INTERPRET=interpreter, OFFICIAL=official,
        num_warps=4 if interpreter else 8,
    )
