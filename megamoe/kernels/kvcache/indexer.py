"""Indexer scoring kernel: V4 lightning-indexer scores of one query per request over its FP4 keys.

``scores[b, t] = sum_h weights[b, h] * relu(q[b, h] . key_t)`` for ``t < n_entries[b]``, ``-inf`` for
``n_entries[b] <= t < max_entries`` and for entries without storage (slot outside ``[0, num_slots)``,
unallocated page, page id outside ``[0, num_pages)``). Keys are read from the paged pool through the block
table and decoded in-kernel; products accumulate in float32. Reference: ``megamoe.reference.kvcache.
indexer_scores`` (float64; agreement to float32 summation order).

v2 layout of the work: one program per (row, TILES consecutive tiles of BLOCK entries). The query
(H x KEY_DIM bf16, split into its even and odd dims) and the head weights are loaded once per program; per
tile the packed keys (BLOCK x KEY_DIM/2 bytes) are decoded in registers to bf16 with the block scale folded
in, and two full-size dots ``(BLOCK x KEY_DIM/2) @ (KEY_DIM/2 x H)`` (even and odd dims: the packed bytes
never need interleaving) give the (BLOCK, H) logits.

* ``OFFICIAL`` (E2M1 + E8M0 power-of-two scale per 32 dims): the scale ``2**(e - 127)`` is folded into
  the decode factor (``2**(e - 9)``, the decode's ``2**118`` convention; exact because it is a power of two
  and ``e2m1 * 2**(e-127) * 2**-8`` is a normal or subnormal bf16 for E8M0 bytes ``e`` in [3, 136], i.e.
  scales 2**-124 .. 2**9). A tile holding a live entry with a byte outside that range (0xFF = NaN
  included) is recomputed by the exact per-32-block path (v1: one K = 16 dot pair per block on the
  unscaled codes, ``partial * scale`` in float32), so any E8M0 scale stays exact.
* NVFP4 (E4M3 scale per 16 dims): E2M1 code * E4M3 scale is exact in bf16 (<= 2 + 4 significant bits).

The FP4 -> bf16 decode is the GEMM kernels' (``nvfp4_gemm``: keys come out as ``k * 2**-8``, undone on the
scores).

Errors (``megamoe/ops/errors.py``; -1 is the legitimate "none" marker for slots and pages and is never an
error): a slot < -1 or >= num_slots, an entry ``t < n_entries`` (of a valid slot) past the block table, and a
block-table page id < -1 or >= num_pages set their bit in the error word with one predicated atomic per program.
"""
import triton
import triton.language as tl

from ..nvfp4_jit import decode_e2m1_pairs_portable, decode_e2m1_pairs_sm90, e4m3_scale_factor_2p118
from ..pdl import grid_dependency_prologue, pdl_enabled
from ..topk import _ordered

#: Entries per tile (GPU, interpreter).
BLOCK_T = {"gpu": 128, "interpreter": 16}
#: Most tiles one program loops over (GPU); the launcher picks a power of two <= this from B and the
#: context so that the grid keeps >= ~8 programs per SM.
MAX_TILES = 8
#: Streaming multiprocessors assumed when no CUDA device is visible (H100 SXM).
DEFAULT_SMS = 132
#: E8M0 bytes whose scale folds exactly into the bf16 decode factor.
FOLD_MIN, FOLD_MAX = 3, 136


@triton.jit
def _decode(packed, factor, INTERPRET: tl.constexpr):
    if INTERPRET:
        return decode_e2m1_pairs_portable(packed, factor)
    else:
        return decode_e2m1_pairs_sm90(packed, factor)


@triton.jit
def _dot_pair(k_even, k_odd, q_even_t, q_odd_t, INTERPRET: tl.constexpr):
    """(BLOCK, D) even/odd keys x (D, H) even/odd query dims -> (BLOCK, H) float32."""
    if INTERPRET:  # the interpreter's bf16 dot is wrong; the bf16 values are exact in float32
        acc = tl.dot(k_even.to(tl.float32), q_even_t.to(tl.float32))
        acc = tl.dot(k_odd.to(tl.float32), q_odd_t.to(tl.float32), acc)
    else:
        acc = tl.dot(k_even, q_even_t)
        acc = tl.dot(k_odd, q_odd_t, acc)
    return acc


@triton.jit
def _official_exact_logits(key_data_ptr, key_scale_ptr, q_row, src, live,
                           H: tl.constexpr, KEY_DIM: tl.constexpr, BLOCK: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """v1 path: per 32-dim block, the dot of the unscaled codes times the E8M0 scale in float32 (any byte)."""
    HALF: tl.constexpr = KEY_DIM // 2
    GROUPS32: tl.constexpr = KEY_DIM // 32
    i16 = tl.arange(0, 16)[None, :]
    unit = tl.full((BLOCK, 16), 2.0 ** 118, tl.float32)  # scale 1 in the decode's 2**118 convention
    logits = tl.zeros((BLOCK, H), dtype=tl.float32)
    for g in tl.static_range(GROUPS32):
        packed = tl.load(key_data_ptr + src[:, None] * HALF + g * 16 + i16, mask=live[:, None], other=0)
        q_even = tl.load(q_row + g * 32 + 2 * i16)
        q_odd = tl.load(q_row + g * 32 + 2 * i16 + 1)
        k_even, k_odd = _decode(packed, unit, INTERPRET)
        part = _dot_pair(k_even, k_odd, tl.trans(q_even), tl.trans(q_odd), INTERPRET)
        sbyte = tl.load(key_scale_ptr + src * GROUPS32 + g, mask=live, other=0).to(tl.int32)
        scale = (sbyte << 23).to(tl.float32, bitcast=True)
        scale = tl.where(sbyte == 0xFF, float("nan"), scale)
        logits += part * scale[:, None]
    return logits


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
    INTERPRET: tl.constexpr, OFFICIAL: tl.constexpr, TILES: tl.constexpr = 1,
    tile_max_ptr=None, tile_max_stride=0, EMIT_MAX: tl.constexpr = False,
    err_ptr=None,                 # (1,) int32 error word (megamoe/ops/errors.py)
    FLAG_SLOTS: tl.constexpr = 0, FLAG_ENTRIES: tl.constexpr = 0, FLAG_TABLE: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0)
    HALF: tl.constexpr = KEY_DIM // 2
    slot = tl.load(slots_ptr + row).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    n = tl.minimum(tl.load(n_entries_ptr + row), max_entries)
    i = tl.arange(0, HALF)
    hh = tl.arange(0, H)
    q_row = q_ptr + row * (H * KEY_DIM) + hh[:, None] * KEY_DIM
    # once per program: the query's even / odd dims as (HALF, H) dot operands and the head weights
    q_even, q_odd = tl.split(tl.reshape(tl.load(q_row + tl.arange(0, KEY_DIM)[None, :]), (H, HALF, 2)))
    q_even_t = tl.trans(q_even)
    q_odd_t = tl.trans(q_odd)
    w = tl.load(weights_ptr + row * H + hh)
    out_row = scores_ptr + row.to(tl.int64) * max_entries
    GUARD: tl.constexpr = FLAG_SLOTS | FLAG_ENTRIES | FLAG_TABLE != 0  # False: compiled out (MEGAMOE_DEVICE_GUARD=0)
    err = ((slot < -1) | (slot >= num_slots)).to(tl.int32) * FLAG_SLOTS * (tl.program_id(1) == 0).to(tl.int32)
    for j in range(TILES):
        t = (tl.program_id(1) * TILES + j) * BLOCK + tl.arange(0, BLOCK)
        live = (t < n) & slot_ok
        page = tl.load(block_table_ptr + tl.where(slot_ok, slot, 0) * max_lb + t // EPB,
                       mask=live & (t // EPB < max_lb), other=-1)
        if GUARD:
            err = err | tl.max((live & (t // EPB >= max_lb)).to(tl.int32), 0) * FLAG_ENTRIES \
                | tl.max(((page < -1) | (page >= num_pages)).to(tl.int32), 0) * FLAG_TABLE
        live = live & (page >= 0) & (page < num_pages)
        src = tl.where(live, page, 0).to(tl.int64) * EPB + t % EPB
        packed = tl.load(key_data_ptr + src[:, None] * HALF + i[None, :], mask=live[:, None], other=0)
        if OFFICIAL:
            GROUPS32: tl.constexpr = KEY_DIM // 32
            sb = tl.load(key_scale_ptr + src[:, None] * GROUPS32 + tl.arange(0, GROUPS32)[None, :],
                         mask=live[:, None], other=127).to(tl.int32)
            # 2**(e-127) * 2**118 as float32 bits (e in [FOLD_MIN, FOLD_MAX]: a normal float32), one per
            # 32-dim block, broadcast over the block's 16 packed bytes
            f = ((tl.minimum(tl.maximum(sb, 3), 136) + 118) << 23).to(tl.float32, bitcast=True)
            factor = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK, GROUPS32, 16)), (BLOCK, HALF))
            unfoldable = tl.max(tl.max(((sb < 3) | (sb > 136)).to(tl.int32), 1), 0)
        else:
            GROUPS: tl.constexpr = KEY_DIM // 16
            # one E4M3 decode per 16-element group (as scale * 2**118), broadcast over the group's 8 bytes
            scale_code = tl.load(key_scale_ptr + src[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :],
                                 mask=live[:, None], other=0).to(tl.int32)
            factor = tl.reshape(tl.broadcast_to(e4m3_scale_factor_2p118(scale_code)[:, :, None],
                                                (BLOCK, GROUPS, 8)), (BLOCK, HALF))
        # exact bf16 keys * 2**-8 (the GEMM's FP4 decode: inline asm on the GPU, integer bit patterns in the
        # interpreter); the 2**8 goes back onto the logits (a power of two: same rounding)
        k_even, k_odd = _decode(packed, factor, INTERPRET)
        logits = _dot_pair(k_even, k_odd, q_even_t, q_odd_t, INTERPRET) * 256.0
        if OFFICIAL:
            if unfoldable != 0:  # rare: a scale outside the foldable range (or NaN): exact per-block path
                logits = _official_exact_logits(key_data_ptr, key_scale_ptr, q_row, src, live,
                                                H, KEY_DIM, BLOCK, INTERPRET) * 256.0
        # relu that keeps NaN (a NaN key scale must give a NaN score): the GPU max.f32 returns the non-NaN operand
        score = tl.sum(tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :], axis=1)
        score = tl.where(live, score, float("-inf"))
        tl.store(out_row + t, score, mask=t < max_entries)
        if EMIT_MAX:  # v3: the tile's maximum order-preserving key (the top-k's row maximum without a pass)
            tile = tl.program_id(1) * TILES + j
            tmax = tl.max(tl.where(t < max_entries, _ordered(score), -2147483648), 0)
            tl.store(tile_max_ptr + row.to(tl.int64) * tile_max_stride + tile, tmax, mask=tile * BLOCK < max_entries)
    if GUARD:
        tl.atomic_or(err_ptr, err, mask=err != 0)


def _num_sms(device) -> int:
    import torch

    if device is not None and getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def tiles_per_program(B: int, max_entries: int, *, interpreter: bool = False, num_sms: int = DEFAULT_SMS) -> int:
    """Tiles one program loops over (shape-only host choice): 1 while the grid is small, up to MAX_TILES
    once there are more than ~8 tiles per SM (the query load is then shared by several tiles)."""
    block = BLOCK_T["interpreter" if interpreter else "gpu"]
    tiles = B * triton.cdiv(max_entries, block)
    t = 1
    while t < (2 if interpreter else MAX_TILES) and tiles // (2 * t) >= 8 * num_sms:
        t *= 2
    return t


def launch_indexer_scores(q, weights, slots, n_entries, block_table, index_keys, index_key_scale_u8, scores,
                          *, entries_per_block: int, official: bool, interpreter: bool = False,
                          tiles: int | None = None, tile_max=None, error_word=None):
    """q: (B, H, Di) bf16 contiguous; weights: (B, H) float32; slots, n_entries: (B,) int32;
    block_table: (S, L) int32; index_keys: (P*EPB, Di // 2) uint8; index_key_scale_u8: (P*EPB, Di // 32)
    E8M0 (official) or (P*EPB, Di // 16) E4M3 bytes; scores: (B, max_entries) float32 output.
    ``tiles``: override of :func:`tiles_per_program` (tests). ``tile_max``: optional (B, >= cdiv(max_entries,
    BLOCK)) int32 view with unit column stride: per BLOCK-entry tile the maximum order-preserving key of its
    scores (``megamoe.kernels.topk`` key map), for the split top-k (v3, replaces its S1 pass).
    ``error_word``: the (1,) int32 word the out-of-range arguments flag (default: the device's,
    ``megamoe.ops.errors``)."""
    from ...ops import errors

    B, H, key_dim = q.shape
    max_entries = scores.shape[1]
    if B == 0 or max_entries == 0:
        return
    block = BLOCK_T["interpreter" if interpreter else "gpu"]
    if tiles is None:
        tiles = tiles_per_program(B, max_entries, interpreter=interpreter,
                                  num_sms=DEFAULT_SMS if interpreter else _num_sms(q.device))
    grid = (B, triton.cdiv(triton.cdiv(max_entries, block), tiles))
    pdl = pdl_enabled(q)
    _indexer_scores_kernel[grid](
        q, weights, slots, n_entries, block_table, index_keys, index_key_scale_u8, scores,
        max_entries, block_table.shape[0], block_table.shape[1], index_keys.shape[0] // entries_per_block,
        H=H, KEY_DIM=key_dim, EPB=entries_per_block, BLOCK=block, INTERPRET=interpreter, OFFICIAL=official,
        TILES=tiles, tile_max_ptr=scores if tile_max is None else tile_max,
        tile_max_stride=0 if tile_max is None else tile_max.stride(0), EMIT_MAX=tile_max is not None,
        err_ptr=error_word if error_word is not None else errors.error_word(q.device),
        FLAG_SLOTS=errors.kernel_flag("indexer_scores", "slots"),
        FLAG_ENTRIES=errors.kernel_flag("indexer_scores", "n_entries"),
        FLAG_TABLE=errors.kernel_flag("indexer_scores", "block_table"),
        num_warps=4 if interpreter else 8, PDL=pdl, launch_pdl=pdl,
    )
