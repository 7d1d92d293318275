"""NVFP4 weight x bf16 activation GEMMs for Hopper: dense and grouped (MoE experts).

One kernel family, one launcher (:func:`launch_nvfp4_gemm`).

Hopper has no FP4 tensor cores, so each program loads packed E2M1 weight bytes
and their E4M3 block scales, decodes them *exactly* to bf16 in registers
(``e2m1 * block_scale`` has at most 6 significant bits, so the bf16 product is
exact), and feeds the bf16 tensor cores with ``tl.dot`` (fp32 accumulation).
The per-tensor / per-expert / per-row ``global_scale`` is applied to the fp32
accumulator in the epilogue.

Swap-AB: the kernel computes ``out^T = W @ x^T`` tile by tile. The decoded
weight tile (BLOCK_N, BLOCK_K) is the *left* operand, which wgmma may take
straight from registers, and the activation tile x^T (BLOCK_K, BLOCK_M) is the
right operand, staged through shared memory by the software pipeline. The
token dimension is therefore the MMA's N dimension: decode tiles with 1-16
tokens per expert use BLOCK_M = 16 and waste nothing on the weight side.

Grouped scheduling without host syncs: rows are sorted by expert and
``expert_offsets`` (E,) int32 holds cumulative row ends on the device. Every
program reads the offsets once, builds the per-expert tile counts and their
prefix sum in registers, and walks a *persistent* loop over work items
``(m-tile, n-tile)``; the total number of work items is known only on the
device and bounds the loop. Rows at or beyond ``expert_offsets[E-1]`` form a
pseudo-expert ``E`` whose tiles skip the K loop and store zeros. The grid is
sized from host-known upper bounds (``cdiv(T, BLOCK_M) + E + 1`` m-tiles) and
capped at a few programs per SM, so nothing is read back to the host and the
launch is CUDA-graph capturable.

Epilogue options: bias (dense), and a fused SwiGLU for gate/up weights stored in
the interleaved layout (row 2j = gate j, row 2j+1 = up j).

Triton interpreter (CPU tests, ``INTERPRET`` constexpr): with Triton 3.6 and
numpy 2.x the interpreter cannot use a tensor as a ``range()`` bound, computes
bf16 ``tl.dot`` wrongly, truncates fp32 -> bf16 casts and flushes bf16
subnormals, so that path uses while loops, fp32 dots on exactly-representable
values, an explicit round-to-nearest-even cast and an fp32 form of the decode.
The GPU path (inline PTX decode, hardware E4M3 conversion) is sm_90 only here;
no ``tl.dot_scaled`` path for sm_100/sm_120 is provided.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..nvfp4_jit import (
    decode_e2m1_pairs_portable,
    decode_e2m1_pairs_sm90,
    e4m3_scale_factor_2p118,
    round_to_bf16,
)

# ---------------------------------------------------------------------------
# Tile configurations, keyed by shape bucket.
#
# Key: upper bound on rows per expert (T / E for grouped, M for dense); the
# first key >= rows_per_expert wins. Values: (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages, programs_per_sm, split_even_odd). The space was swept
# on an H100 with ``benchmarks/bench_gemm.py --tune`` (candidates listed there;
# results in benchmarks/results/gemm_*.md and benchmarks/NOTES_gemm.md).
#   decode (<= 32 rows per expert): the token dimension is the MMA's N (16 or
#     32); weights stream through 64-row tiles, 4 programs per SM.
#   prefill: BLOCK_M = 128-256 tokens per weight tile amortises the FP4 decode
#     (the ALU cost per weight element) over as many tokens as registers allow.
# ---------------------------------------------------------------------------
GEMM_CONFIGS = {
    4: (16, 64, 128, 4, 3, 4, True),
    32: (32, 64, 128, 4, 3, 4, True),
    64: (64, 128, 64, 8, 3, 1, False),
    256: (128, 128, 128, 8, 3, 1, False),
    1 << 62: (256, 128, 64, 8, 3, 1, False),
}
# Small configurations for the Triton interpreter (CPU tests): tiny tiles so
# that masking, multi-tile experts and the persistent loop are all exercised,
# with both K orders (split even/odd for decode-like shapes, joined otherwise).
INTERPRETER_CONFIGS = {
    True: (16, 32, 64, 4, 1, 1, True),
    False: (16, 32, 64, 4, 1, 1, False),
}
INTERPRETER_PROGRAMS = 3


def select_config(rows_per_expert: int, interpreter: bool):
    """Pick (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs_per_sm, split_even_odd)."""
    if interpreter:
        return INTERPRETER_CONFIGS[rows_per_expert <= 4]
    for bound, config in GEMM_CONFIGS.items():
        if rows_per_expert <= bound:
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def _load_weight_step(w_ptrs, s_ptrs, kt, col_mask, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr):
    """Packed bytes (BLOCK_N, BLOCK_K//2) and scale bytes (BLOCK_N, BLOCK_K//16) of K step ``kt``.

    Masks are only emitted for a ragged K edge (EVEN_K false); rows past N
    are clamped by the caller instead of masked.
    """
    k0 = kt * BLOCK_K
    if EVEN_K and EVEN_N:
        packed = tl.load(w_ptrs + k0 // 2)
        scale_bytes = tl.load(s_ptrs + k0 // 16)
    else:
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 16)
        packed = tl.load(w_ptrs + k0 // 2, mask=col_mask[:, None] & ((k0 // 2 + offs_b) < K // 2)[None, :], other=0)
        scale_mask = col_mask[:, None] & ((k0 // 16 + offs_g) < K // 16)[None, :]
        scale_bytes = tl.load(s_ptrs + k0 // 16, mask=scale_mask, other=0)
    return packed, scale_bytes


@triton.jit
def _mma_step(
    acc, packed, scale_bytes, kt, x_ptrs, row_mask, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_EVEN_ODD: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc (BLOCK_N, BLOCK_M) fp32 += decode(W step kt) @ x^T step kt (the decoded W carries 2**-8).

    SPLIT_EVEN_ODD: x_ptrs is (BLOCK_K//2, BLOCK_M) pointing at the even K
    elements; the low nibbles multiply the even x elements and the high nibbles
    the odd ones in two half-K dots (no register shuffles on the weight side:
    the decode-bound small-M path). Otherwise x_ptrs is (BLOCK_K, BLOCK_M) and
    the two nibble halves are interleaved back into K order (one full dot).
    """
    k0 = kt * BLOCK_K
    if INTERPRET:
        factor = e4m3_scale_factor_2p118(scale_bytes.to(tl.int32))
    else:
        # hardware e4m3 -> f16 -> f32 conversion (exact; 0x7F/0xFF -> NaN), times 2**118 (exact)
        factor = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e35
    factor = tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)).reshape(BLOCK_N, BLOCK_K // 2)
    if INTERPRET:
        w_even, w_odd = decode_e2m1_pairs_portable(packed, factor)
    else:
        w_even, w_odd = decode_e2m1_pairs_sm90(packed, factor)
    if SPLIT_EVEN_ODD:
        # one contiguous (pipelined) load, de-interleaved in registers
        offs_k = tl.arange(0, BLOCK_K)
        if EVEN_K:
            xk_mask = row_mask[None, :]
        else:
            xk_mask = ((k0 + offs_k) < K)[:, None] & row_mask[None, :]
        xt = tl.load(x_ptrs + k0, mask=xk_mask, other=0.0)
        x_even, x_odd = tl.split(tl.permute(xt.reshape(BLOCK_K // 2, 2, xt.shape[1]), (0, 2, 1)))
        if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 values are exact in fp32
            acc = tl.dot(w_even.to(tl.float32), x_even.to(tl.float32), acc, input_precision="ieee")
            return tl.dot(w_odd.to(tl.float32), x_odd.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(w_even, x_even, acc)
        return tl.dot(w_odd, x_odd, acc)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = row_mask[None, :]
        else:
            x_mask = ((k0 + offs_k) < K)[:, None] & row_mask[None, :]
        xt = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        if INTERPRET:
            w = tl.join(w_even, w_odd).reshape(BLOCK_N, BLOCK_K)  # low nibble = even element
            return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        w = tl.join(w_even, w_odd).reshape(BLOCK_N, BLOCK_K)  # low nibble = even element
        return tl.dot(w, xt, acc)


# num_rows / num_programs change from call to call: no value specialisation, so a warmed-up
# model never recompiles when the token count changes (only the config bucket can).
@triton.jit
def expert_row_ranges(offsets_ptr, num_rows, num_experts, BLOCK_E: tl.constexpr):
    """Per lane of ``BLOCK_E`` (lane e < E: expert e, lane E: the padding pseudo-expert ``[offsets[E-1], T)``, later
    lanes empty): (lane, starts, ends, counts), row ranges clamped to ``[0, num_rows]`` (counts >= 0 even where
    offsets decrease against the contract)."""
    lane = tl.arange(0, BLOCK_E)
    ends = tl.load(offsets_ptr + lane, mask=lane < num_experts, other=num_rows)
    prev = tl.load(offsets_ptr + lane - 1, mask=(lane >= 1) & (lane <= num_experts), other=0)
    starts = tl.where(lane > num_experts, num_rows, prev)
    ends = tl.minimum(tl.maximum(ends, 0), num_rows)
    starts = tl.minimum(tl.maximum(starts, 0), num_rows)
    return lane, starts, ends, tl.maximum(ends - starts, 0)


@triton.jit
def _tile_table(offsets_ptr, num_rows, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                GROUPED: tl.constexpr):
    """The m-tile table the persistent grouped kernels walk: (lane, starts, ends, tiles, tile_ends, total_tiles).
    Grouped: per-"expert" row ranges clamped to [0, num_rows], lane E being the padding pseudo-expert
    [offsets[E-1], T); m-tiles per expert and their inclusive prefix sums. Dense: only ``total_tiles`` (the
    other entries are unused placeholders for :func:`_work_rows`)."""
    if GROUPED:
        lane, starts, ends, counts = expert_row_ranges(offsets_ptr, num_rows, num_experts, BLOCK_E)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)
        total_tiles = tl.sum(tiles, 0)
    else:
        total_tiles = (num_rows + BLOCK_M - 1) // BLOCK_M
        lane, tiles, tile_ends, starts, ends = 0, 0, 0, 0, 0
    return lane, starts, ends, tiles, tile_ends, total_tiles


@triton.jit
def _work_rows(tile, lane, tile_ends, tiles, starts, ends, num_experts, num_rows, BLOCK_M: tl.constexpr,
               GROUPED: tl.constexpr):
    """Rows of persistent m-tile ``tile``: (row_start, row_end, is_real, expert_c). Grouped: ``lane`` indexes the
    per-expert vectors ``tiles`` / ``tile_ends`` (m-tiles, inclusive prefix sums) and ``starts`` / ``ends`` (rows),
    lane E being the padding pseudo-expert (``is_real`` False); dense: tiles of ``num_rows``."""
    if GROUPED:
        expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
        here = lane == expert
        first_tile = tl.sum(tl.where(here, tile_ends - tiles, 0), 0)
        row_start = tl.sum(tl.where(here, starts, 0), 0) + (tile - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(here, ends, 0), 0)
        is_real = expert < num_experts
        expert_c = tl.minimum(expert, num_experts - 1).to(tl.int64)
    else:
        row_start = tile * BLOCK_M
        row_end = num_rows
        is_real = row_start >= 0
        expert_c = 0
    return row_start, row_end, is_real, expert_c


@triton.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows"])
def _nvfp4_gemm_kernel(
    x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
    num_rows, N, K, num_experts, swiglu_limit, num_programs, num_src_rows,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUPED: tl.constexpr, HAS_ROW_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, SPLIT_EVEN_ODD: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr, ERR_FLAG: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N  # (tl.cdiv gives a 1-element tensor in the interpreter)

    lane, starts, ends, tiles, tile_ends, total_tiles = _tile_table(offsets_ptr, num_rows, num_experts, BLOCK_M,
                                                                    BLOCK_E, GROUPED)
    total_work = total_tiles * n_tiles

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, BLOCK_K // 16)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K

    # Persistent loop over work items (m-tile major, n-tile minor): programs
    # that run concurrently share an expert's m-tiles, so its weights stay in L2.
    work = pid
    bad_rows = 0  # row_index values outside [0, num_src_rows) seen by this program (one flag at the end)
    while work < total_work:
        tile = work // n_tiles
        n_start = (work % n_tiles) * BLOCK_N
        row_start, row_end, is_real, expert_c = _work_rows(tile, lane, tile_ends, tiles, starts, ends, num_experts,
                                                           num_rows, BLOCK_M, GROUPED)

        rows = row_start + offs_m
        row_mask = rows < row_end
        if HAS_ROW_INDEX:
            # an out-of-range row_index reads zero activations (the row is dropped) and is flagged
            src_rows = tl.load(row_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            if ERR_FLAG != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only)
                src_ok = (src_rows >= 0) & (src_rows < num_src_rows)
                bad_rows += tl.sum((row_mask & ~src_ok & is_real).to(tl.int32), 0)
                x_mask = row_mask & src_ok
                src_rows = tl.where(src_ok, src_rows, 0)
            else:
                x_mask = row_mask
        else:
            src_rows = rows.to(tl.int64)
            x_mask = row_mask
        cols = n_start + offs_n
        col_mask = cols < N
        if EVEN_N:
            w_cols = cols
        else:
            w_cols = tl.minimum(cols, N - 1)  # clamp instead of masking; the store masks the columns

        x_ptrs = x_ptr + src_rows[None, :] * stride_xm + offs_k[:, None]
        w_ptrs = w_ptr + expert_c * stride_we + w_cols[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
        s_ptrs = scale_ptr + expert_c * stride_se + w_cols[:, None].to(tl.int64) * stride_sn + offs_g[None, :]

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_iters = tl.where(is_real, k_tiles, 0)
        if INTERPRET:
            # The interpreter cannot take a tensor as a range() bound (numpy >= 2): use a while loop.
            kt = 0
            while kt < k_iters:
                pa, sa = _load_weight_step(w_ptrs, s_ptrs, kt, col_mask, K, BLOCK_K, EVEN_K, True)
                acc = _mma_step(acc, pa, sa, kt, x_ptrs, x_mask, K, BLOCK_N, BLOCK_K, SPLIT_EVEN_ODD, EVEN_K, True)
                kt += 1
        else:
            # Triton's software pipeliner stages both the weight bytes and the
            # activation tile through shared memory (cp.async, num_stages deep).
            # (A hand-written register prefetch of the weights defeated it.)
            for kt in range(0, k_iters):
                pa, sa = _load_weight_step(w_ptrs, s_ptrs, kt, col_mask, K, BLOCK_K, EVEN_K, True)
                acc = _mma_step(acc, pa, sa, kt, x_ptrs, x_mask, K, BLOCK_N, BLOCK_K, SPLIT_EVEN_ODD, EVEN_K, False)

        gscale = tl.load(
            global_scale_ptr + expert_c * stride_ge + cols.to(tl.int64) * stride_gn, mask=col_mask, other=0.0
        )
        acc = acc * (gscale * 256.0)[:, None]  # the decoded weights carry a factor 2**-8
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            acc = acc + bias[:, None]
        acc = tl.where(is_real, acc, 0.0)
        result = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
        out_rows = rows.to(tl.int64)[:, None] * stride_om
        if SWIGLU:
            gate, up = tl.split(result.reshape(BLOCK_M, BLOCK_N // 2, 2))
            y = swiglu_clamped(gate, up, swiglu_limit, HAS_LIMIT)
            half_cols = n_start // 2 + tl.arange(0, BLOCK_N // 2)
            tl.store(
                out_ptr + out_rows + half_cols[None, :],
                round_to_bf16(y, INTERPRET),
                mask=row_mask[:, None] & (half_cols < N // 2)[None, :],
            )
        else:
            tl.store(
                out_ptr + out_rows + cols[None, :],
                round_to_bf16(result, INTERPRET),
                mask=row_mask[:, None] & col_mask[None, :],
            )
        work += num_programs
    if HAS_ROW_INDEX:
        if ERR_FLAG != 0:
            tl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)


def gemm_error_word(device, error_word=None) -> tuple[torch.Tensor, int]:
    """(error word, row_index flag bit) shared by the GEMM launchers of this family; the bit is 0 when the device
    guard is compiled out (``megamoe.ops.errors.DEVICE_GUARD``): the kernels then neither mask nor flag."""
    from ...ops import errors

    return (error_word if error_word is not None else errors.error_word(device)), \
        errors.kernel_flag("nvfp4_grouped_mm", "row_index")


@triton.jit
def swiglu_clamped(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """float32 ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` as ``gate / (1 + exp(-gate)) * up``, the SwiGLU
    epilogue of the Triton GEMM kernels (``HAS_LIMIT`` False: no clamp). A NaN gate / up stays NaN (``tl.where`` keeps
    the value when the comparison is false), as the reference's clamp."""
    if HAS_LIMIT:
        gate = tl.where(gate > swiglu_limit, swiglu_limit, gate)
        up = tl.where(up > swiglu_limit, swiglu_limit, up)
        up = tl.where(up < -swiglu_limit, -swiglu_limit, up)
    return gate / (1.0 + tl.exp(-gate)) * up


def global_scale_strides(global_scale: torch.Tensor, grouped: bool) -> tuple[int, int]:
    """(stride per expert, stride per output row) of a broadcastable global scale (0 = broadcast)."""
    if global_scale.dim() == 0:
        return 0, 0
    shape, strides = global_scale.shape, global_scale.stride()
    stride_gn = strides[-2] if global_scale.dim() >= 2 and shape[-2] != 1 else 0
    stride_ge = 0
    if grouped and global_scale.dim() == 3 and shape[0] != 1:
        stride_ge = strides[0]
    return stride_ge, stride_gn


def launch_nvfp4_gemm(
    x: torch.Tensor,
    data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    swiglu_limit: float | None = None,
    interpreter: bool = False,
    config=None,
    error_word: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the NVFP4 GEMM (inputs already validated by ``megamoe.ops.gemm``).

    Dense (``expert_offsets is None``): x (M, K) bf16; data (N, K//2) uint8;
    block_scale (N, K//16) float8_e4m3fn; global_scale 0-d or (N, 1) fp32;
    out (M, N) bf16. Grouped: x (T, K) bf16 sorted by expert, or (S, K) with
    ``row_index`` (T,) int32; data (E, N, K//2); block_scale (E, N, K//16);
    global_scale 0-d, (E, 1, 1) or (E, N, 1) fp32; expert_offsets (E,) int32;
    out (T, N) bf16, or (T, N//2) with ``swiglu``. Last dimensions contiguous.
    A ``row_index`` value outside ``[0, S)`` reads zero activations and sets the
    ``("nvfp4_grouped_mm", "row_index")`` bit of ``error_word`` (default: the
    device's word, ``megamoe.ops.errors.error_word``).
    """
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k_half = data.shape[-2], data.shape[-1]
    k = 2 * k_half
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    rows_per_expert = max(1, num_rows // num_experts) if grouped else num_rows
    block_m, block_n, block_k, num_warps, num_stages, per_sm, split = (
        config or select_config(rows_per_expert, interpreter))
    m_tiles_bound = triton.cdiv(num_rows, block_m) + (num_experts + 1 if grouped else 0)
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    if interpreter:
        programs = min(work_bound, INTERPRETER_PROGRAMS)
    else:
        programs = min(work_bound, _num_sms(x.device.index or 0) * per_sm)
    stride_ge, stride_gn = global_scale_strides(global_scale, grouped)
    scale_u8 = block_scale.view(torch.uint8)
    err, err_flag = gemm_error_word(out.device, error_word)
    _nvfp4_gemm_kernel[(programs,)](
        x, row_index if row_index is not None else x, data, scale_u8, global_scale,
        expert_offsets if grouped else x, bias if bias is not None else x, out, err,
        num_rows, n, k, num_experts, float(swiglu_limit) if swiglu_limit is not None else 0.0, programs,
        x.shape[0],
        x.stride(0), data.stride(0) if grouped else 0, data.stride(-2),
        scale_u8.stride(0) if grouped else 0, scale_u8.stride(-2), stride_ge, stride_gn, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(num_experts + 1) if grouped else 1,
        GROUPED=grouped, HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, SPLIT_EVEN_ODD=split, EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, INTERPRET=interpreter,
        ERR_FLAG=err_flag, num_warps=num_warps, num_stages=num_stages,
    )
    return out
