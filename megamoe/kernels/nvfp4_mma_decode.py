"""Decode-shaped NVFP4 x bf16 GEMMs on Hopper tensor cores (Gluon, ``mma.sync``): dense and grouped.

One kernel family, one launcher (:func:`launch_nvfp4_mma_decode`).

Why: at 1-64 tokens the work is streaming the touched experts' FP4 bytes, and
a kernel is only memory-bound if it spends fewer than ~5.6 instructions per
weight (the H100 issues ~29.7 T thread-instructions/s against 5.3 T weights/s
at 3.0 TB/s). The CUDA-core kernel (``nvfp4_gemv.py``) needs 5.3 per weight
per row group; the Triton tensor-core kernel (``nvfp4_gemm.py``) ~6.8, most of
it re-packing the decoded weights into the MMA operand layout. This kernel is
written in Gluon, Triton's explicit-layout dialect, so the packed bytes are
loaded straight into the registers that the ``mma.sync.m16n8k16`` A operand
needs, and decoding is the only per-weight work: ~2.4 instructions per
weight for 8 or 16 tokens at a time (offline SASS count, see
``tests/kernels/test_nvfp4_mma_decode.py``).

Register mapping (per 16 weight rows and BLOCK_K = 32*W K elements per step):
lane ``q = lane % 4`` of a quad owns the contiguous K range
``[q*BLOCK_K/4, (q+1)*BLOCK_K/4)`` of its rows (one 16-byte load per 32 K);
the MMA's K order is a permutation of memory K (the dot product does not care
which, as long as both operands use the same one): ``kappa = c0 + 2q + 8c1 +
16nib + 32i`` for memory ``k = q*BLOCK_K/4 + 8i + 2(2c1 + c0) + nib`` (word
``i``, byte ``c``, nibble ``nib``). With it the decode of one 32-bit word of
packed weights (``prmt`` + and/multiply/and per bf16 pair + ``mul.bf16x2`` by
the block scale, exact as in ``nvfp4_jit``) produces exactly four A-operand
registers, and the activations need one ``prmt`` per register to pair
(k, k+2) - amortised over all weight rows of a warp. The block scale is the
same for all bytes of a word (a word is 8 K elements of one 16-element block).
No shared memory, no layout conversion in the K loop; the next K step's
weights, scales and activations are loaded before the current step is decoded
(register double-buffering).

Grid (grouped): ``(cdiv(N, BLOCK_N), min(E, T) + 1)`` exactly as the CUDA-core
kernel: slot ``j`` takes the ``j``-th non-empty expert, found on the device
from ``expert_offsets``; the last slot writes zeros to the padding rows
``[offsets[E-1], T)``; an expert with more than BLOCK_M rows loops over them
(the weight slab is streamed again per BLOCK_M rows, from L2 when it is still
there). Dense: one slot. Sync-free and CUDA-graph capturable.

Epilogues: ``global_scale`` (0-d, per expert, per row) times ``2**8`` (the
decode carries ``2**-8``), bias (dense), SwiGLU with optional clamp on the
interleaved gate/up rows, row gather (``row_index``) in the activation loads.

Requirements (checked by :func:`mma_decode_supports`): a CUDA device of
compute capability 9.x, Triton with Gluon (3.6), K a multiple of BLOCK_K,
16-byte aligned rows. Other shapes use the Triton kernels. Gluon kernels do
not run in the Triton interpreter: the CPU test-suite compiles this kernel for
sm_90 (no GPU needed) and checks its loop; the numerical tests run on the GPU.
"""
from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its API is used as of 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    GLUON_AVAILABLE = False

from .nvfp4_gemm import global_scale_strides

# ---------------------------------------------------------------------------
# Tile configurations. Key: upper bound on the average rows per touched expert
# (host-known: ceil(T / min(E, T)); M for dense); the first key >= it wins.
# Values: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, PREFETCH).
#   BLOCK_M: token rows per MMA tile (the MMA's N: 8 or 16); more rows loop.
#   BLOCK_N: weight rows per program (16 per warp and register repeat).
#   BLOCK_K: K elements per step; each lane loads BLOCK_K/8 bytes per weight row.
#   PREFETCH: K steps of weights in flight ahead of the one being decoded (1 or 2).
# ---------------------------------------------------------------------------
# H100 sweep (benchmarks/results/gemm_v6_mma.md, gemm_v6b_prefetch.md; NOTES_gemm.md): (8, 128, 256, 4, 1)
# is the best or within 5% of it at 1, 8 and 64 tokens (top-8 of 256 experts) for both projections;
# at 512 tokens (16 rows per expert) BLOCK_M = 32 wins (2600 us vs 3240 with 16). PREFETCH = 2 was
# slower everywhere (the extra register moves; 1 token is bound by the streaming rate, see
# benchmarks/results/probe_stream.md).
MMA_DECODE_CONFIGS = {
    4: (8, 128, 256, 4, 1),
    1 << 62: (32, 128, 128, 4, 1),
}
# Routing bounds (megamoe/ops/gemm.py: decode_route). Grouped: up to 32 rows per expert on average
# (top-8 of 256 experts: 1024 tokens); measured faster than the Triton tensor-core kernel at 1, 8, 64
# and 512 tokens and than the CUDA-core kernel at 8 and 64 (equal at 1). Dense: never yet - without
# split-K a dense GEMM has only N/BLOCK_N programs (N=4096, M=1: 59 us vs 26 us on the CUDA-core kernel).
MMA_DECODE_MAX_ROWS_PER_EXPERT = 32
MMA_DECODE_MAX_DENSE_ROWS = 0


def select_mma_decode_config(rows_per_expert: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, PREFETCH) for ``rows_per_expert`` average rows and K
    (BLOCK_K drops to 128 when it does not divide K)."""
    for bound, config in MMA_DECODE_CONFIGS.items():
        if rows_per_expert <= bound:
            if k % config[2]:
                config = config[:2] + (128,) + config[3:]
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def mma_decode_supports(x: torch.Tensor, data: torch.Tensor, block_k: int = 128) -> bool:
    """Whether this kernel can run the shape: sm_90 CUDA tensors, K % 128 == 0, 16-byte aligned rows."""
    if not (GLUON_AVAILABLE and x.is_cuda and _capability(x.device.index or 0)[0] == 9):
        return False
    k = 2 * data.shape[-1]
    return (k % block_k == 0 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0
            and data.is_contiguous() and data.data_ptr() % 16 == 0)


def mma_decode_preferred(num_rows: int, num_experts: int | None) -> bool:
    """Host-shape rule: decode-sized row counts (``num_experts`` None: dense)."""
    if num_experts is None:
        return num_rows <= MMA_DECODE_MAX_DENSE_ROWS
    return num_rows <= MMA_DECODE_MAX_ROWS_PER_EXPERT * num_experts


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _row_bases(BLOCK_N, num_warps):
        """(register bases, warp bases) of the weight rows: row+8 in a register, 16 rows per warp, repeats."""
        regs = [8]
        warps = [16 << w for w in range(num_warps.bit_length() - 1)]
        r = 16 * num_warps
        while r < BLOCK_N:
            regs.append(r)
            r *= 2
        return regs, warps

    @gluon.constexpr_function
    def _weight_layout(BLOCK_N, BLOCK_K, num_warps):
        """(BLOCK_N, BLOCK_K//8) int32 words of packed bytes: lane q of a quad holds BLOCK_K/32 contiguous words."""
        row_regs, row_warps = _row_bases(BLOCK_N, num_warps)
        regs = [[0, 1 << b] for b in range((BLOCK_K // 32).bit_length() - 1)] + [[r, 0] for r in row_regs]
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 32], [0, BLOCK_K // 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[w, 0] for w in row_warps], block_bases=[], shape=[BLOCK_N, BLOCK_K // 8])

    @gluon.constexpr_function
    def _scale_layout(BLOCK_N, BLOCK_K, num_warps):
        """(BLOCK_N, BLOCK_K//16) scale bytes, the blocks of the same lane's bytes."""
        row_regs, row_warps = _row_bases(BLOCK_N, num_warps)
        regs = [[0, 1 << b] for b in range((BLOCK_K // 64).bit_length() - 1)] + [[r, 0] for r in row_regs]
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 64], [0, BLOCK_K // 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[w, 0] for w in row_warps], block_bases=[], shape=[BLOCK_N, BLOCK_K // 16])

    @gluon.constexpr_function
    def _x_layout(BLOCK_M, BLOCK_K, num_warps):
        """(BLOCK_M, BLOCK_K//2) activation bf16 pairs: token = lane // 4 (+8 per register), lane q's K range."""
        regs = [[0, 1 << b] for b in range((BLOCK_K // 8).bit_length() - 1)]
        t = 8
        while t < BLOCK_M:
            regs.append([t, 0])
            t *= 2
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=[[0, BLOCK_K // 8], [0, BLOCK_K // 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[BLOCK_M, BLOCK_K // 2])

    @gluon.jit
    def _decode_words(packed, factor):
        """Packed bytes (uint8) x fp32 ``scale * 2**118`` -> (low-nibble, high-nibble) bf16 ``e2m1 * scale * 2**-8``.

        Four bytes (one word, one block scale) per call: ``prmt`` puts bytes
        (b0, b1) and (b2, b3) in the two 16-bit halves; per half-pair of nibbles
        an ``and`` isolates them, one integer multiply by ``2**6 + 2**12``
        (high nibbles: ``2**2 + 2**8``) writes non-overlapping copies so that
        a second ``and`` leaves the E2M1 magnitude at bf16 bits 6-8 and the sign
        at bit 15 (``e2m1 * 2**-126``; 0.5 is a bf16 subnormal), and one
        ``mul.rn.bf16x2`` by the factor gives ``e2m1 * scale * 2**-8`` exactly.
        Outputs: (lo(b0), lo(b1)), (lo(b2), lo(b3)) and the same for the high nibbles.
        """
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t0, t1, a, s;
            cvt.rn.bf16x2.f32 s, $5, $5;
            prmt.b32 t0, $4, 0, 0x7170;
            prmt.b32 t1, $4, 0, 0x7372;
            and.b32 a, t0, 0x000F000F;
            mul.lo.u32 a, a, 4160;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $0, a, s;
            and.b32 a, t1, 0x000F000F;
            mul.lo.u32 a, a, 4160;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $1, a, s;
            and.b32 a, t0, 0x00F000F0;
            mul.lo.u32 a, a, 260;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $2, a, s;
            and.b32 a, t1, 0x00F000F0;
            mul.lo.u32 a, a, 260;
            and.b32 a, a, 0x81C081C0;
            mul.rn.bf16x2 $3, a, s;
            }
            """,
            constraints="=r,=r,=r,=r,r,r,r,r,r",
            args=[packed, factor],
            dtype=(gl.bfloat16, gl.bfloat16),
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def _load_weights(w_ptrs, s_ptrs, k0):
        """Weight words and scale bytes of the step starting at K element ``k0`` (int32 words: the
        loop carries whole registers, not bytes)."""
        return gl.load(w_ptrs + k0 // 8), gl.load(s_ptrs + k0 // 16)

    @gluon.jit
    def _word_bytes(words):
        """(R, C) int32 -> (R, 4C) uint8, little-endian byte order (register moves only)."""
        b0 = (words & 0xFF).to(gl.uint8)
        b1 = ((words >> 8) & 0xFF).to(gl.uint8)
        b2 = ((words >> 16) & 0xFF).to(gl.uint8)
        b3 = ((words >> 24) & 0xFF).to(gl.uint8)
        return gl.join(gl.join(b0, b2), gl.join(b1, b3)).reshape([words.shape[0], 4 * words.shape[1]])

    @gluon.jit
    def _pair_halves(pairs):
        """(R, C) int32 of bf16 pairs -> (R, 2C) bf16 (low half first)."""
        lo = pairs.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.join(lo, hi).reshape([pairs.shape[0], 2 * pairs.shape[1]])

    @gluon.jit
    def _mma_step(acc, words, scale_bytes, x_pairs, a_layout: gl.constexpr, b_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        # block-scale factor (hardware e4m3 -> f32, exact; 0x7F -> NaN) * 2**118, one per word
        factor = scale_bytes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622794e35
        factor = gl.join(factor, factor).reshape([BLOCK_N, BLOCK_K // 8])
        factor = gl.join(factor, factor)
        factor = gl.join(factor, factor).reshape([BLOCK_N, BLOCK_K // 2])
        packed = _word_bytes(words)
        lo, hi = _decode_words(packed, gl.convert_layout(factor, packed.type.layout))
        # (n, byte, nib) -> MMA K order kappa = c0 + 2q + 8c1 + 16nib + 32i
        w = gl.join(lo, hi).reshape([BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2])  # n, q, i, c1, c0, nib
        w = w.permute([0, 2, 5, 3, 1, 4]).reshape([BLOCK_N, BLOCK_K])  # n, i, nib, c1, q, c0
        x = _pair_halves(x_pairs).reshape([BLOCK_M, 4, BLOCK_K // 32, 2, 2, 2])  # m, q, i, c1, c0, nib (memory order)
        x = x.permute([0, 2, 5, 3, 1, 4]).reshape([BLOCK_M, BLOCK_K]).permute([1, 0])
        return mma_v2(gl.convert_layout(w, a_layout), gl.convert_layout(x, b_layout), acc)

    @gluon.jit
    def _expert_of_slot(offsets_ptr, slot, num_experts, num_rows, BLOCK_E: gl.constexpr, num_warps: gl.constexpr):
        """(expert, row_start, row_end) of the slot-th non-empty expert (row_end 0 when there is none)."""
        lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        lane = gl.arange(0, BLOCK_E, layout=lane_layout)
        ends = gl.load(offsets_ptr + lane, mask=lane < num_experts, other=0)
        starts = gl.load(offsets_ptr + lane - 1, mask=(lane >= 1) & (lane < num_experts), other=0)
        ends = gl.minimum(gl.maximum(ends, 0), num_rows)
        starts = gl.minimum(gl.maximum(starts, 0), num_rows)
        active = (ends > starts) & (lane < num_experts)
        rank = gl.associative_scan(active.to(gl.int32), 0, _add_i32)  # 1-based rank of non-empty experts
        here = active & (rank == slot + 1)
        expert_p1 = gl.sum(gl.where(here, lane + 1, 0), axis=0)
        row_start = gl.sum(gl.where(here, starts, 0), axis=0)
        row_end = gl.sum(gl.where(here, ends, 0), axis=0)
        return gl.maximum(expert_p1 - 1, 0), row_start, gl.where(expert_p1 > 0, row_end, 0)

    @gluon.jit
    def _add_i32(a, b):
        return a + b

    @gluon.jit(do_not_specialize=["num_rows"])
    def _nvfp4_mma_decode_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr,
        num_rows, N, K, num_experts, swiglu_limit,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, PREFETCH: gl.constexpr, num_warps: gl.constexpr,
    ):
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = _weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = _scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_layout: gl.constexpr = _x_layout(BLOCK_M, BLOCK_K, num_warps)

        pid_n = gl.program_id(0)
        slot = gl.program_id(1)
        if GROUPED:
            expert, row_start, row_end = _expert_of_slot(offsets_ptr, slot, num_experts, num_rows, BLOCK_E,
                                                         num_warps)
            # the last slot owns the padding rows [offsets[E-1], T): zeros, no weight traffic
            last_end = gl.minimum(gl.maximum(gl.load(offsets_ptr + num_experts - 1), 0), num_rows)
            is_pad = slot == gl.num_programs(1) - 1
            row_start = gl.where(is_pad, last_end, row_start)
            row_end = gl.where(is_pad, num_rows, row_end)
            k_steps = gl.where(is_pad, 0, K // BLOCK_K)
            expert = expert.to(gl.int64)
        else:
            row_start = pid_n * 0
            row_end = num_rows
            k_steps = K // BLOCK_K
            expert = 0

        # weight rows past N are clamped (re-read), the stores mask them
        w_rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
        w_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        w_ptrs = w_ptr + expert * stride_we + w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
        s_rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
        s_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        s_ptrs = scale_ptr + expert * stride_se + s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
        x_cols = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, x_layout))

        epi_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, num_warps], [1, 0])
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, epi_layout))
        col_mask = cols < N
        gscale = gl.load(global_scale_ptr + expert * stride_ge + gl.minimum(cols, N - 1).to(gl.int64) * stride_gn)
        gscale = gscale * 256.0  # the decoded weights carry 2**-8
        if HAS_BIAS:
            bias = gl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(gl.float32)

        r0 = row_start
        while r0 < row_end:
            rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
            row_mask = rows < row_end
            if HAS_ROW_INDEX:
                src_rows = gl.load(row_index_ptr + rows, mask=row_mask, other=0).to(gl.int64)
            else:
                src_rows = rows.to(gl.int64)
            x_ptrs = x_ptr + src_rows[:, None] * stride_xm + x_cols[None, :]
            x_mask = row_mask[:, None]
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            # Register prefetch: the weights of steps i+1..i+PREFETCH and the activations of step i+1
            # are in flight while step i is decoded (x is small and L2-resident, the weights stream
            # from HBM); loads past the end re-load the last step (in bounds) and are discarded.
            last = gl.maximum(k_steps - 1, 0) * BLOCK_K
            words, scale_bytes = _load_weights(w_ptrs, s_ptrs, 0)
            x_pairs = gl.load(x_ptrs, mask=x_mask, other=0)
            if PREFETCH == 2:
                words_1, scale_1 = _load_weights(w_ptrs, s_ptrs, gl.minimum(BLOCK_K, last))
            for step in range(0, k_steps):
                x_next = gl.load(x_ptrs + gl.minimum((step + 1) * BLOCK_K, last) // 2, mask=x_mask, other=0)
                if PREFETCH == 2:
                    words_2, scale_2 = _load_weights(w_ptrs, s_ptrs, gl.minimum((step + 2) * BLOCK_K, last))
                    acc = _mma_step(acc, words, scale_bytes, x_pairs, a_layout, b_layout, BLOCK_N, BLOCK_M, BLOCK_K)
                    words, scale_bytes = words_1, scale_1
                    words_1, scale_1 = words_2, scale_2
                else:
                    words_1, scale_1 = _load_weights(w_ptrs, s_ptrs, gl.minimum((step + 1) * BLOCK_K, last))
                    acc = _mma_step(acc, words, scale_bytes, x_pairs, a_layout, b_layout, BLOCK_N, BLOCK_M, BLOCK_K)
                    words, scale_bytes = words_1, scale_1
                x_pairs = x_next

            result = gl.convert_layout(acc.permute([1, 0]), epi_layout) * gscale[None, :]  # (BLOCK_M, BLOCK_N)
            if HAS_BIAS:
                result = result + bias[None, :]
            result = gl.where(k_steps > 0, result, 0.0)  # padding rows (the bias included) are zeros
            out_rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, epi_layout))
            out_mask = out_rows < row_end
            out_base = out_ptr + out_rows.to(gl.int64)[:, None] * stride_om
            if SWIGLU:
                gate, up = gl.split(result.reshape([BLOCK_M, BLOCK_N // 2, 2]))
                if HAS_LIMIT:
                    gate = gl.minimum(gate, swiglu_limit)
                    up = gl.maximum(gl.minimum(up, swiglu_limit), -swiglu_limit)
                y = gate / (1.0 + gl.exp(-gate)) * up
                half_layout: gl.constexpr = y.type.layout
                half_cols = pid_n * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2,
                                                               layout=gl.SliceLayout(0, half_layout))
                half_rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, half_layout))
                gl.store(out_ptr + half_rows.to(gl.int64)[:, None] * stride_om + half_cols[None, :],
                         y.to(gl.bfloat16),
                         mask=(half_rows < row_end)[:, None] & (half_cols < N // 2)[None, :])
            else:
                gl.store(out_base + cols[None, :], result.to(gl.bfloat16),
                         mask=out_mask[:, None] & col_mask[None, :])
            r0 += BLOCK_M


def compile_for_sm90(config=(8, 64, 256, 4, 1), *, grouped=True, row_index=True, bias=False, swiglu=False,
                     swiglu_limit=True):
    """Compile the kernel for sm_90 on any machine (no GPU needed); returns Triton's compiled kernel.

    For tests and offline inspection (``.asm["ptx"]``, ``.asm["cubin"]``): the
    arguments are specialised the way a launch with 16-byte aligned pointers,
    strides and N, K specialises them.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_m, block_n, block_k, num_warps, prefetch = config
    kernel = _nvfp4_mma_decode_kernel
    pointers = dict(x_ptr="*i32", row_index_ptr="*i32", w_ptr="*i32", scale_ptr="*u8", global_scale_ptr="*fp32",
                    offsets_ptr="*i32", bias_ptr="*bf16", out_ptr="*bf16")
    scalars = ["num_rows", "N", "K", "num_experts", "stride_xm", "stride_we", "stride_wn", "stride_se",
               "stride_sn", "stride_ge", "stride_gn", "stride_om"]
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=256, GROUPED=grouped,
                     HAS_ROW_INDEX=row_index, HAS_BIAS=bias, SWIGLU=swiglu, HAS_LIMIT=swiglu_limit,
                     PREFETCH=prefetch, num_warps=num_warps)
    signature = dict(pointers, **{name: "i32" for name in scalars}, swiglu_limit="fp32",
                     **{name: "constexpr" for name in constants})
    aligned = list(pointers) + ["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                "stride_om"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def launch_nvfp4_mma_decode(
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
) -> torch.Tensor:
    """Launch the decode-shaped tensor-core NVFP4 GEMM (inputs validated by ``megamoe.ops.gemm``).

    Same contract as :func:`megamoe.kernels.nvfp4_gemm.launch_nvfp4_gemm`;
    additionally :func:`mma_decode_supports` must hold (sm_90, K % BLOCK_K == 0,
    16-byte aligned rows). ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, PREFETCH),
    else :func:`select_mma_decode_config`. ``interpreter`` must be False.
    """
    if interpreter:
        raise ValueError("interpreter: the Gluon decode kernel runs on sm_90 GPUs only")
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    rows_per_expert = triton.cdiv(num_rows, min(num_experts, num_rows)) if grouped else num_rows
    block_m, block_n, block_k, num_warps, prefetch = config or select_mma_decode_config(rows_per_expert, k)
    if k % block_k:
        raise ValueError(f"data: K={k} must be a multiple of BLOCK_K={block_k} for this kernel")
    slots = min(num_experts, num_rows) + 1 if grouped else 1
    stride_ge, stride_gn = global_scale_strides(global_scale, grouped)
    scale_u8 = block_scale.view(torch.uint8)
    x32 = x.view(torch.int32)  # bf16 pairs
    data32 = data.view(torch.int32)  # 4 packed bytes = 8 K elements per word
    grid = (triton.cdiv(n, block_n), slots)
    _nvfp4_mma_decode_kernel[grid](
        x32, row_index if row_index is not None else x32, data32, scale_u8, global_scale,
        expert_offsets if grouped else x32, bias if bias is not None else x, out,
        num_rows, n, k, num_experts, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        x32.stride(0), data32.stride(0) if grouped else 0, data32.stride(-2),
        scale_u8.stride(0) if grouped else 0, scale_u8.stride(-2), stride_ge, stride_gn, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts)) if grouped else 32 * num_warps,
        GROUPED=grouped, HAS_ROW_INDEX=row_index is not None, HAS_BIAS=bias is not None,
        SWIGLU=swiglu, HAS_LIMIT=swiglu_limit is not None, PREFETCH=prefetch, num_warps=num_warps,
    )
    return out
