"""Prefill-shaped NVFP4 x bf16 GEMMs on Hopper tensor cores (Gluon, ``wgmma``): grouped and dense.

One kernel, one launcher (:func:`launch_nvfp4_wgmma`).

Swap-AB: each program computes ``out^T`` tiles ``W (BLOCK_N weight rows, 16
per warp) @ x^T (BLOCK_K x BLOCK_M tokens)``. The weight tile is decoded from
FP4 straight into the wgmma A-operand registers (``nvfp4_gluon_jit.py``:
decoding is the only per-weight work); the activations are loaded into
registers one K step ahead, permuted to the MMA's K order, and staged in one of
two shared-memory buffers (NVMMA 128-byte swizzle) for the B operand. The wgmma
is synchronous: an overlapped variant (decode of step i+1 while step i's wgmma
runs, A registers pinned through ``warpgroup_mma_wait``) was slower at 255
registers (benchmarks/results/gemm_v7c_wgmma_overlap.md).

Persistent grouped schedule without host syncs (as ``nvfp4_gemm.py``): every
program reads ``expert_offsets`` once, builds per-expert m-tile counts and
their prefix sum in registers, and walks work items (m-tile major, n-tile
minor) ``pid, pid + P, ...``; rows at or beyond ``offsets[E-1]`` form a
pseudo-expert whose tiles store zeros. Sync-free and CUDA-graph capturable.

Requirements: as the decode kernel (``gluon_supports``), and BLOCK_N = 16 *
num_warps, BLOCK_M >= 8 * num_warps.
"""
from __future__ import annotations

import os

import torch
import triton

from ...format.mma_order import MMA_K_GROUP
from .mma_k_order import launch_to_mma_k_order
from .nvfp4_gemm import _num_sms
from .nvfp4_gluon_jit import GLUON_AVAILABLE, compile_sm90, kernel_arguments
from .nvfp4_mma_decode import MMA_DECODE_MAX_ROWS_PER_EXPERT

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .nvfp4_gluon_jit import (
        decode_a_operand,
        gathered_source_rows,
        grouped_tile_table,
        load_weights,
        locate_tile,
        scale_layout,
        store_epilogue,
        weight_layout,
        wgmma_k_loop,
        x_split_layout,
    )

# (BLOCK_M token rows = the wgmma N, BLOCK_N weight rows = 16 * num_warps, BLOCK_K, num_warps, programs per SM).
# H100 sweep (benchmarks/results/gemm_v7_wgmma.md): best at 4096 tokens of top-8 / 256 experts (128 rows
# per expert); BLOCK_M = 256 spills registers.
WGMMA_CONFIG = (128, 128, 128, 8, 1)
# Routing (megamoe/ops/gemm.py): grouped GEMMs with more rows per expert than the decode kernel takes and
# at most this many. Measured faster than the Triton tensor-core kernel at 128 rows per expert (gate_up
# 7380 vs 8704 us), slower at 512 (gate_up 23851 vs 23515, down 14103 vs 11501); NOTES_gemm.md has the
# points in between.
WGMMA_MAX_ROWS_PER_EXPERT = 256
# The x ring (NOTES_gemm.md, v16): x permuted to the MMA K order once per GEMM (megamoe/format/mma_order.py),
# its tiles by cp.async into a ring of this many slots, asynchronous wgmma chain; 0 = today's kernel. Opt-in
# (env MEGAMOE_WGMMA_X_RING=4, read at import) until measured on the H100. Needs BLOCK_K = 128 and K a multiple
# of X_RING * 128 (else the launcher runs today's loop).
WGMMA_X_RING = int(os.environ.get("MEGAMOE_WGMMA_X_RING", "0") or 0)


def wgmma_preferred(num_rows: int, num_experts: int | None) -> bool:
    """Host-shape rule: grouped, between the decode kernel's bound and WGMMA_MAX_ROWS_PER_EXPERT."""
    if num_experts is None:
        return False
    return MMA_DECODE_MAX_ROWS_PER_EXPERT * num_experts < num_rows <= WGMMA_MAX_ROWS_PER_EXPERT * num_experts


if GLUON_AVAILABLE:

    @gluon.jit
    def _ring_step(acc, a_cur, a_prev, words, scale_bytes, x_ring, xr_ptrs, xr_mask, w_ptrs, s_ptrs, step, k_steps,
                   last, slot: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   X_RING: gl.constexpr):
        """One K step of the x-ring loop: issue the async MMA of ``step`` (A = ``a_cur``, x from ring ``slot``),
        refill the slot read two steps ago, wait for the MMA of ``step - 1`` (``a_prev`` is free after it), decode
        step + 1 and load the words of step + 2. Returns (acc, A of step + 1, words, scale bytes)."""
        async_copy.wait_group(X_RING - 3)  # this thread's copies of `step` have landed
        fence_async_shared()  # ... and are ordered before the async proxy's (wgmma's) reads
        gl.thread_barrier()  # everyone's have; every warpgroup's MMA of step - 2 is complete
        acc = warpgroup_mma(a_cur, x_ring.index(slot).permute([1, 0]), acc, is_async=True)
        ahead = step + X_RING - 2  # its slot was read by the MMA of step - 2 (complete: the barrier above)
        if ahead < k_steps:
            async_copy.async_copy_global_to_shared(x_ring.index((slot + X_RING - 2) % X_RING),
                                                   xr_ptrs + ahead * BLOCK_K, mask=xr_mask)
        async_copy.commit_group()
        acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
        a_next = decode_a_operand(words, scale_bytes, a_layout, BLOCK_N, BLOCK_K)  # past the end: re-decoded, unused
        words, scale_bytes = load_weights(w_ptrs, s_ptrs, gl.minimum((step + 2) * BLOCK_K, last))
        return acc, a_next, words, scale_bytes

    @gluon.jit(do_not_specialize=["num_rows", "num_programs", "num_src_rows", "row_lo", "own_pad"])
    def _nvfp4_wgmma_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, row_lo, own_pad,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, num_warps: gl.constexpr,
        X_RING: gl.constexpr = 0,
    ):
        """Prefill-shaped NVFP4 GEMM: weight tile decoded into wgmma A registers, x^T tile through shared memory.

        X_RING = S (even, >= 4; NOTES_gemm.md v16): x is already in the MMA K order in memory
        (``megamoe.format.mma_order.to_mma_k_order``); its tiles go by cp.async straight into an S-slot shared-memory
        ring (S - 2 steps ahead, no x in registers) and the wgmma chain is asynchronous (step i's MMAs run while
        step i+1 is decoded). The K loop is unrolled S times: K must be a multiple of S * BLOCK_K (the launcher
        checks)."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_layout: gl.constexpr = x_split_layout(BLOCK_M, BLOCK_K, num_warps)
        # one activation buffer (a double-buffered variant measured ~30% slower: gemm_v8.md; the compiler
        # keeps two barriers per step either way)
        x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if X_RING >= 3:
            x_ring = gl.allocate_shared_memory(gl.bfloat16, [X_RING, BLOCK_M, BLOCK_K], x_smem_layout)
            # 16-byte cp.async chunks: 8 bf16 per thread along K, 16 threads per 128-K row
            xr_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [num_warps, 1],
                                                       [1, 0])
            xr_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xr_layout))
            x_bf16 = x_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)
        else:
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], x_smem_layout)
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        if GROUPED:
            # row band: only experts with more than row_lo rows; the padding lane only with own_pad
            lane, starts, ends, tiles, tile_ends, total_tiles = grouped_tile_table(
                offsets_ptr, num_rows, num_experts, row_lo, None, own_pad, BLOCK_M, BLOCK_E, 1, num_warps)
        else:
            total_tiles = (num_rows + BLOCK_M - 1) // BLOCK_M
        total_work = total_tiles * n_tiles

        w_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        s_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        x_cols = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, x_layout))
        k_tiles = K // BLOCK_K
        # persistent loop over work items (m-tile major, n-tile minor: programs running together
        # share an expert's m-tile, so its activations and weights stay in L2)
        work = gl.program_id(0)
        bad_rows = 0  # row_index values outside [0, num_src_rows) (masked once per tile, flagged once)
        while work < total_work:
            tile = work // n_tiles
            n_start = (work % n_tiles) * BLOCK_N
            if GROUPED:
                row_start, row_end, expert = locate_tile(tile, lane, starts, ends, tiles, tile_ends, BLOCK_M)
                is_real = expert < num_experts
                expert_c = gl.minimum(expert, num_experts - 1).to(gl.int64)
            else:
                row_start = tile * BLOCK_M
                row_end = num_rows
                is_real = row_start >= 0
                expert_c = 0
            w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
            w_ptrs = w_ptr + expert_c * stride_we + w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
            s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
            s_ptrs = scale_ptr + expert_c * stride_se + s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
            rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
            row_mask = rows < row_end
            if HAS_ROW_INDEX:
                src_rows = gl.load(row_index_ptr + rows, mask=row_mask, other=0).to(gl.int64)
                if ERR_FLAG != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0, benchmarking only)
                    src_ok = (src_rows >= 0) & (src_rows < num_src_rows)
                    bad_rows += gl.sum((row_mask & ~src_ok & is_real).to(gl.int32), axis=0)
                    row_mask = row_mask & src_ok  # the x loads only: the epilogue stores by row_end
                    src_rows = gl.where(src_ok, src_rows, 0)
            else:
                src_rows = rows.to(gl.int64)
            x_ptrs = x_ptr + src_rows[:, None] * stride_xm + x_cols[None, :]
            x_mask = row_mask[:, None]
            k_steps = gl.where(is_real, k_tiles, 0)
            last = gl.maximum(k_steps - 1, 0) * BLOCK_K
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0)
            if X_RING >= 3:
                # gathered rows of the MMA-K-ordered x (rows past the tile end read a valid row: their
                # accumulator columns are never stored)
                r_rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xr_layout))
                r_ok = r_rows < row_end
                if HAS_ROW_INDEX:
                    r_src, _, xr_mask = gathered_source_rows(row_index_ptr, r_rows, r_ok, num_src_rows)
                else:
                    r_src = gl.where(r_ok, r_rows, 0).to(gl.int64)
                    xr_mask = None
                xr_ptrs = x_bf16 + r_src[:, None] * (2 * stride_xm) + xr_cols[None, :]
                gl.thread_barrier()  # every warpgroup's MMAs of the previous tile have read the ring
                for j in gl.static_range(X_RING - 2):
                    if j < k_steps:
                        async_copy.async_copy_global_to_shared(x_ring.index(j), xr_ptrs + j * BLOCK_K, mask=xr_mask)
                    async_copy.commit_group()
                a_cur = decode_a_operand(words, scale_bytes, a_layout, BLOCK_N, BLOCK_K)
                a_prev = a_cur
                words, scale_bytes = load_weights(w_ptrs, s_ptrs, gl.minimum(BLOCK_K, last))
                # unrolled by the ring size: static slots, and the two A register sets swap roles without copies
                for step0 in range(0, k_steps, X_RING):
                    for u in gl.static_range(X_RING):
                        acc, a_next, words, scale_bytes = _ring_step(
                            acc, a_cur, a_prev, words, scale_bytes, x_ring, xr_ptrs, xr_mask, w_ptrs, s_ptrs, step0 + u,
                            k_steps, last, u, a_layout, BLOCK_N, BLOCK_K, X_RING)
                        a_prev = a_cur
                        a_cur = a_next
                acc = warpgroup_mma_wait(0, deps=[acc, a_cur, a_prev])[0]
            else:
                acc = wgmma_k_loop(acc, w_ptrs, s_ptrs, x_ptrs, x_mask, x_smem, k_steps, a_layout, BLOCK_N, BLOCK_M,
                                   BLOCK_K)
            store_epilogue(acc, row_start, row_end, is_real, n_start, N, global_scale_ptr, expert_c, stride_ge,
                      stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, SWIGLU,
                      HAS_LIMIT, num_warps)
            work += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)


def compile_for_sm90(config=WGMMA_CONFIG, *, grouped=True, row_index=True, bias=False, swiglu=False,
                     swiglu_limit=True, x_ring=0):
    """Compile the kernel for sm_90 without a GPU (tests, offline SASS); ``config`` as the launcher's;
    ``x_ring``: the x ring slots (0: today's kernel)."""
    scalars = ["num_rows", "N", "K", "num_experts", "num_programs", "row_lo", "own_pad",
               "stride_xm", "stride_we", "stride_wn",
               "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om"]
    return compile_sm90(_nvfp4_wgmma_kernel, scalars, config[:3], config[3], grouped=grouped,
                        row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                        extra_constants=dict(X_RING=x_ring))


def launch_nvfp4_wgmma(
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
    row_lo: int = 0,
    own_pad: bool = True,
    x_ring: int | None = None,
) -> torch.Tensor:
    """Launch the prefill-shaped Gluon wgmma NVFP4 GEMM (same contract as
    :func:`megamoe.kernels.gemm.nvfp4_mma_decode.launch_nvfp4_mma_decode`).

    Grouped only: ``row_lo``: compute only the experts with more than ``row_lo``
    rows (the upper band of :func:`megamoe.ops.gemm.plan_row_bands`; other
    experts' rows are left untouched); ``own_pad``: write zeros to the padding
    rows ``[offsets[E-1], T)``.

    Persistent grid of ``min(work upper bound, SMs * programs_per_sm)`` programs
    over (m-tile, n-tile) work items; the work count is only known on the device.
    ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs_per_sm). ``x_ring``: the x ring slots (default
    :data:`WGMMA_X_RING`; 0 = today's loop; used when BLOCK_K = 128 and K % (x_ring * 128) == 0): x is copied
    once into the MMA K order (a (S, K) bf16 temporary) and streamed by cp.async.
    """
    if interpreter:
        raise ValueError("interpreter: the Gluon kernels run on sm_90 GPUs only")
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    block_m, block_n, block_k, num_warps, per_sm = config or WGMMA_CONFIG
    if k % block_k:
        raise ValueError(f"data: K={k} must be a multiple of BLOCK_K={block_k} for this kernel")
    if block_n != 16 * num_warps:
        raise ValueError(f"config: BLOCK_N={block_n} must be 16 * num_warps={16 * num_warps}")
    # each expert in the band (more than row_lo rows: at most T // (row_lo + 1) of them) and the padding
    # adds at most one partial tile to the T / BLOCK_M full ones
    m_tiles_bound = triton.cdiv(num_rows, block_m) + (
        min(num_experts, num_rows // (row_lo + 1)) + 1 if grouped else 0)
    work_bound = m_tiles_bound * triton.cdiv(n, block_n)
    programs = min(work_bound, _num_sms(x.device.index or 0) * per_sm)
    x_ring = WGMMA_X_RING if x_ring is None else x_ring
    if x_ring and (x_ring < 4 or x_ring % 2 or block_k != MMA_K_GROUP or k % (x_ring * block_k)):
        if x_ring < 4 or x_ring % 2:
            raise ValueError(f"x_ring: expected 0 or an even number of slots >= 4, got {x_ring}")
        x_ring = 0  # this shape runs today's loop
    if x_ring:
        x = launch_to_mma_k_order(x)
    head, strides, flags = kernel_arguments(x, data, block_scale, global_scale, out, expert_offsets=expert_offsets,
                                            row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                                            error_word=error_word)
    _nvfp4_wgmma_kernel[(programs,)](
        *head, programs, row_lo if grouped else 0, int(own_pad), *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts + 1)) if grouped else 32 * num_warps,
        num_warps=num_warps, X_RING=x_ring, **flags,
    )
    return out
