"""Decode-shaped NVFP4 x bf16 GEMMs on Hopper tensor cores (Gluon, ``mma.sync``): dense and grouped.

One kernel, one launcher (:func:`launch_nvfp4_mma_decode`).

At 1-64 tokens the work is streaming the touched experts' FP4 bytes, and a
kernel is only memory-bound if it spends fewer than ~5.6 instructions per
weight (the H100 issues ~29.7 T thread-instructions/s against 5.3 T weights/s
at 3.0 TB/s). The CUDA-core kernel (``nvfp4_gemv.py``) needs 5.3 per weight per
row group. Here the packed words are loaded straight into ``mma.sync.m16n8k16``
A-operand registers and decoded in place (``nvfp4_gluon_jit.py``): ~3.2 SASS
instructions per weight in the K loop for 8 token rows, ~3.6 for 16 (checked
offline by ``tests/kernels/test_nvfp4_gluon.py``). No shared memory in the
K loop; the next step's weights, scales and activations are loaded before the
current step is decoded (register double-buffering). The activation tile
(``BLOCK_M`` tokens, the MMA's N) is held by every warp in B-operand registers.

Grid (grouped): ``(cdiv(N, BLOCK_N), G)``, persistent along the second axis.
A work item is (expert, chunk of BLOCK_M rows); every program builds the
per-expert chunk counts and their prefix sum in registers from
``expert_offsets`` (one scan) and walks chunks ``g, g + G, ...`` for its
n-tile, so an expert with many rows is spread over as many programs as it has
chunks (skewed routing keeps the GPU busy; issue 10). Row band: a launch only
takes the experts whose row count r satisfies ``row_lo < r <= row_hi``
(device values; :func:`megamoe.ops.gemm.plan_row_bands` splits a GEMM into
launches by bands); with ``own_pad`` the padding rows ``[offsets[E-1], T)``
are one more pseudo-expert whose chunks store zeros without weight traffic.
``G = min(chunk bound, resident programs / n-tiles)`` (:func:`mma_decode_grid`):
no more programs than fit on the GPU at once, so empty programs cost nothing
under concentration and the grid-stride loop balances to one item. Dense: the
same loop over the M rows' chunks. Sync-free and CUDA-graph capturable (the
routing may change between replays).

Epilogue (``store_epilogue``): ``global_scale`` (0-d, per expert, per row),
bias (dense), SwiGLU with optional clamp on the interleaved gate/up rows; the
row gather (``row_index``) is fused into the activation loads.

Requirements (:func:`~megamoe.kernels.gemm.nvfp4_gluon_jit.gluon_supports`): a
compute capability 9.x device, Triton with Gluon, K % 128 == 0, 16-byte
aligned rows; other shapes use the Triton kernels.
"""
from __future__ import annotations

import os

import torch
import triton

from ..pdl import (gl_grid_dependency_prologue, gl_launch_dependents, gl_wait_for_previous_grid, pdl_early_reads,
                   pdl_flags, pdl_supported)
from .mma_k_order import launch_to_mma_k_order
from .nvfp4_gemm import _num_sms
from .nvfp4_gluon_jit import GLUON_AVAILABLE, check_weight_interleave, compile_sm90, kernel_arguments

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from .nvfp4_gluon_jit import (
        decode_a_operand,
        gathered_source_rows,
        grouped_tile_table,
        interleaved_offsets,
        load_weights,
        pair_halves,
        locate_tile,
        scale_layout,
        store_epilogue,
        weight_layout,
        x_kappa_order,
        x_operand_layout,
    )

# ---------------------------------------------------------------------------
# Tile configurations. Key: upper bound on the average rows per touched expert
# (host-known: ceil(T / min(E, T)); M for dense); the first key >= it wins.
# Values: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps).
#   BLOCK_M: token rows per MMA tile (the MMA's N: 8, 16 or 32); more rows loop.
#   BLOCK_N: weight rows per program (16 per warp, then register repeats).
#   BLOCK_K: K elements per step; each quad lane loads BLOCK_K/8 bytes per weight row.
# H100 sweeps (benchmarks/results/gemm_v6_mma.md, gemm_v6b_prefetch.md; NOTES_gemm.md): (8, 128, 256, 4)
# is the best or within 5% of it at 1, 8 and 64 tokens (top-8 of 256 experts) for both projections; at
# 512 tokens (16 rows per expert) BLOCK_M = 32 wins (2600 us vs 3240 with 16). Prefetching two K steps
# of weights was slower everywhere (register moves); 1 token is bound by the streaming rate
# (benchmarks/results/probe_stream.md).
# ---------------------------------------------------------------------------
MMA_DECODE_CONFIGS = {
    4: (8, 128, 256, 4),
    1 << 62: (32, 128, 128, 4),
}
# Prototype (benchmarks/NOTES_peer_study.md, not yet measured): env MEGAMOE_MMA_STAGES=S (S >= 2, read at
# import) gives the BLOCK_M 32 config a 5th element: stream the weight words and scale bytes through an
# S-stage cp.async ring in shared memory (S - 1 steps in flight per program) instead of one step of register
# double-buffering. A config may carry this 5th element (stages) in any call; absent or < 2: registers.
# x through shared memory (X_SMEM; NOTES_gemm.md v16): the BLOCK_M values whose launches copy the MMA-K-ordered x
# by cp.async and read it back with ldmatrix instead of holding it in registers. Offline sm_90 at (32, 128, 128, 4)
# + SwiGLU: 4.66 -> 3.84 instructions per weight, 255 -> 187 registers; no gain at BLOCK_M 8 / 16. Opt-in
# (env MEGAMOE_MMA_X_SMEM="32", a comma list, read at import) until measured on the H100.
MMA_X_SMEM_BLOCK_M = frozenset(int(v) for v in os.environ.get("MEGAMOE_MMA_X_SMEM", "").split(",") if v.strip())
MMA_RING_STAGES = int(os.environ.get("MEGAMOE_MMA_STAGES", "0") or 0)
# Measurement switch (issue 11, NOTES_moe_decode.md "x in the paired order"): the launcher copies x into the paired
# order (megamoe/format/mma_order.py: one extra torch launch per GEMM) and the kernel skips its 32 byte permutes per K
# step (the x half of the MMA B operand). Off by default; callers that already hold a paired x pass x_paired=True.
MMA_X_PAIRED = os.environ.get("MEGAMOE_MMA_X_PAIRED", "0") == "1"
if MMA_RING_STAGES >= 2:
    MMA_DECODE_CONFIGS[1 << 62] = MMA_DECODE_CONFIGS[1 << 62] + (MMA_RING_STAGES,)

# Routing bounds (megamoe/ops/gemm.py: decode_route). Grouped: up to 32 rows per expert on average
# (top-8 of 256 experts: 1024 tokens); measured faster than the Triton tensor-core kernel at 1, 8, 64
# and 512 tokens and than the CUDA-core kernel at 8 and 64 (equal at 1). Dense: not yet - without
# split-K a dense GEMM has only N/BLOCK_N programs (N=4096, M=1: 59 us vs 26 us on the CUDA-core kernel).
MMA_DECODE_MAX_ROWS_PER_EXPERT = 32
MMA_DECODE_MAX_DENSE_ROWS = 0
# Row bands of the grouped "banded" route (megamoe/ops/gemm.py: plan_row_bands; NOTES_gemm.md v12): the
# BLOCK_M 8 decode config takes experts with at most MMA_SMALL_BAND_ROWS rows (one chunk), the BLOCK_M 32
# config those with at most MMA_MAX_BAND_ROWS (two chunks: ~0.7 ps per weight vs ~0.98 for one wgmma tile,
# gemm_v6_mma / gemm_v7_wgmma), the wgmma kernel the rest.
MMA_SMALL_BAND_ROWS = 8
MMA_MAX_BAND_ROWS = 64
# Split-K of the grouped decode band (issue 11; NOTES_gemm.md "decode split-K (grouped)"): each work item
# (chunk, n-tile) is split over S K ranges when the host bound on items (real chunks x n-tiles) leaves the GPU
# short of DECODE_SPLITK_PROGRAMS_PER_SM programs per SM: S = cdiv(target, items), at least
# DECODE_SPLITK_MIN_STEPS BLOCK_K steps per split, at most DECODE_SPLITK_MAX_SPLITS. At 1 token (V4: 7 chunks x
# 32 n-tiles) S = 3 -> ~670 programs (~5 per SM, several waves: probe_stream.md, 4 K splits streamed 2.5 TB/s
# vs ~2.2 for one program per row slab); from ~4 tokens up S = 1 (today's kernel, bit for bit).
DECODE_SPLITK_PROGRAMS_PER_SM = 4
DECODE_SPLITK_MIN_STEPS = 2
DECODE_SPLITK_MAX_SPLITS = 8


def ring_stages(stages: int, scale_address: int, scale_strides) -> int:
    """The ring depth a launch can use: ``stages`` when the scale rows it copies with ``cp.async`` (8 or 16
    bytes per row and step) are provably 16-byte aligned (base address and every byte stride a multiple of 16,
    as the JIT specialises them; e.g. K % 256 == 0), else 0 (register double-buffering: a copy the compiler
    cannot prove aligned would be split below cp.async's 4-byte minimum and fail to compile)."""
    if stages < 2 or scale_address % 16 or any(int(v) % 16 for v in scale_strides):
        return 0
    return stages


#: Register cap (ptxas maxnreg) of the register-buffered builds (no weight ring) that read row-interleaved weights
#: (``W_IL`` > 1), per (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): the interleaved offsets took the gathered SwiGLU
#: decode build from 168 to 170 registers, i.e. from 3 to 2 programs per SM, and its gate_up from 90% to 85% of
#: 3.0 TB/s at 64 tokens (ncu: grid 384 -> 256 programs, results/gpu_check_v25/a_ncu_decode64.csv). Capped at 168
#: it keeps 3 (one register spilled, stored and reloaded once before the K loop); its other builds (split-K, no
#: row_index) take 166-168 without the cap. Other configs keep their residency interleaved (their register counts
#: move within one residency step; capping them at 168 would spill 56-192 B).
INTERLEAVED_MAXNREG = {(8, 128, 256, 4): 168}


#: The one-wave decode config (issue 11; NOTES_moe_decode.md "One wave of 8-warp programs at 1 token"): the decode
#: config's tiles with 8 warps instead of 4 (each warp 16 weight rows instead of 32), built under a 128-register cap
#: (126-128 registers, no spill, on both layouts): 2 programs of 8 warps per SM, twice the warps of the 4-warp build
#: (3 programs of 4) wherever the launch's work items fit in one wave of them (:func:`one_wave_decode_config`).
MMA_DECODE_ONE_WAVE_CONFIG = (8, 128, 256, 8)
#: Register cap (ptxas maxnreg) of register-buffered builds on any layout, per (BLOCK_M, BLOCK_N, BLOCK_K, num_warps).
DECODE_MAXNREG = {MMA_DECODE_ONE_WAVE_CONFIG: 128}
#: Host switch of the one-wave rule (env MEGAMOE_DECODE_ONE_WAVE, read at import; "0" off; the value at every call).
DECODE_ONE_WAVE = os.environ.get("MEGAMOE_DECODE_ONE_WAVE", "1").strip() not in ("", "0")


def interleave_constants(config, stages: int, weight_interleave: int) -> dict:
    """The compile keywords of a build reading ``weight_interleave``-row interleaved weights: ``W_IL`` and, for a
    register-buffered build (``stages`` 0) of a config in :data:`INTERLEAVED_MAXNREG` (interleaved) or
    :data:`DECODE_MAXNREG` (any layout), its ``maxnreg``."""
    cap = None
    if stages == 0:
        cap = DECODE_MAXNREG.get(tuple(config[:4]))
        if weight_interleave != 1:
            cap = INTERLEAVED_MAXNREG.get(tuple(config[:4]), cap)
    if weight_interleave == 1:
        return {"maxnreg": cap} if cap else {}
    return dict(W_IL=weight_interleave, **({"maxnreg": cap} if cap else {}))


#: The BLOCK_M 16 band (megamoe/ops/gemm.py: MMA16_BAND): experts with at most this many rows, tile config
#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, ring stages) measured on the H100 at 512 tokens (results/gpu_check_v13b/
#: mma_ring_v1.md: V4-Flash gate_up + down 2096 vs 2263 us uniform, 2148 vs 2322 zipf, same bits as registers).
MMA16_BAND_ROWS = 16
MMA16_CONFIG = (16, 128, 128, 4, 4)  # BLOCK_K 128 divides every K the Gluon kernels take


def select_mma_decode_config(rows_per_expert: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for ``rows_per_expert`` average rows and K
    (BLOCK_K drops to 128 when it does not divide K)."""
    for bound, config in MMA_DECODE_CONFIGS.items():
        if rows_per_expert <= bound:
            if k % config[2]:
                config = config[:2] + (128,) + config[3:]
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


def mma_decode_preferred(num_rows: int, num_experts: int | None) -> bool:
    """Host-shape rule: decode-sized row counts (``num_experts`` None: dense)."""
    if num_experts is None:
        return num_rows <= MMA_DECODE_MAX_DENSE_ROWS
    return num_rows <= MMA_DECODE_MAX_ROWS_PER_EXPERT * num_experts


ROW_HI_UNBOUNDED = 2 ** 31 - 1


def chunk_bound(num_rows: int, num_experts: int, block_m: int, row_lo: int = 0, row_hi: int = ROW_HI_UNBOUNDED,
                own_pad: bool = True, max_rows_per_expert: int | None = None) -> int:
    """Host upper bound on the work chunks of one grouped launch (any routing of ``num_rows`` rows).

    Experts in the band have more than ``row_lo`` rows, so there are at most
    ``min(E, T // (row_lo + 1))`` of them; each has at most ``cdiv(min(row_hi,
    max rows), BLOCK_M)`` chunks, and all of them (plus the padding pseudo-expert)
    at most one partial chunk each on top of ``T // BLOCK_M`` full ones. Only a
    grid size: a routing that breaks ``max_rows_per_expert`` makes programs
    loop more, never skips rows.
    """
    most = num_rows if max_rows_per_expert is None else max(1, min(num_rows, max_rows_per_expert))
    n_band = min(num_experts, num_rows // (row_lo + 1))
    chunks = min(n_band * triton.cdiv(min(row_hi, most), block_m), n_band + num_rows // block_m)
    if own_pad:  # the padding pseudo-expert: up to every row
        chunks = min(chunks + triton.cdiv(num_rows, block_m), n_band + 1 + num_rows // block_m)
    return chunks


def resident_programs(n_regs: int, num_warps: int, shared_bytes: int = 0) -> int:
    """Programs of one kernel that fit on an sm_90 SM at once: 64K registers (allocated per warp in units
    of 256, i.e. 8 per thread), 2048 threads, 32 programs, 227 KB of shared memory."""
    by_regs = 65536 // (max(8, -(-n_regs // 8) * 8) * 32 * num_warps)
    by_smem = (227 * 1024) // shared_bytes if shared_bytes else 32
    return max(1, min(by_regs, 2048 // (32 * num_warps), 32, by_smem))


def one_wave_decode_config(num_rows: int, num_experts: int, n: int, k: int, max_rows_per_expert: int | None,
                           num_sms: int, row_hi: int = ROW_HI_UNBOUNDED):
    """:data:`MMA_DECODE_ONE_WAVE_CONFIG` if every work item of a grouped decode-band launch (chunks of 8 rows, at most
    ``row_hi`` rows per expert, padding included, x n-tiles; host bound :func:`chunk_bound`) fits in one wave of its
    programs (:func:`resident_programs` at its :data:`DECODE_MAXNREG` cap: 2 per SM) and K is a multiple of its
    BLOCK_K, else None (keep the 4-warp config). Host shapes only.
    Measured (H100, read flush, the MoE layer): V4-Flash 1 token 1.07x; where the items need a second round of the
    8-warp programs (V4-Pro 1 token, 2+ tokens) it was 0.91-0.98x, hence the one-wave condition."""
    config = MMA_DECODE_ONE_WAVE_CONFIG
    if not DECODE_ONE_WAVE or k % config[2]:
        return None
    chunks = chunk_bound(num_rows, num_experts, config[0], 0, row_hi, True, max_rows_per_expert)
    items = chunks * triton.cdiv(n, config[1])
    per_sm = resident_programs(DECODE_MAXNREG.get(tuple(config[:4]), 255), config[3])
    return config if items <= per_sm * num_sms else None


_RESIDENT: dict = {}


def _specialization(arg):
    """What Triton specializes a launch argument on (tensors: dtype and 16-byte alignment; ints: == 1, % 16 == 0
    and 32 vs 64 bits; other scalars: their type): two launches with equal keys run the same binary."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int, arg == 1, arg % 16 == 0, -2 ** 31 <= arg < 2 ** 31
    return type(arg)


def compiled_residency(kernel, grid, args, kwargs) -> int:
    """resident_programs of the compiled ``kernel`` for these arguments (compiled once, without a launch;
    cached per specialization (:func:`_specialization` of every argument, so layers whose binaries differ get
    their own figure), so the steady state costs one dictionary look-up)."""
    key = (kernel, tuple(sorted((k, v) for k, v in kwargs.items())), tuple(_specialization(a) for a in args),
           torch.cuda.current_device())
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        if hasattr(compiled, "result"):  # asynchronous compilation mode
            compiled = compiled.result()
        compiled._init_handles()
        _RESIDENT[key] = resident_programs(compiled.n_regs, kwargs["num_warps"], compiled.metadata.shared)
    return _RESIDENT[key]


def mma_decode_grid(num_sms: int, resident: int, n: int, chunks: int, block_n: int) -> tuple[int, int]:
    """(n-tiles, G): G programs per n-tile, at most the chunk bound and what stays resident on the GPU
    (``resident`` programs per SM): every program starts at once, the grid-stride loop balances to a chunk."""
    n_tiles = triton.cdiv(n, block_n)
    return n_tiles, max(1, min(chunks, resident * num_sms // n_tiles))


def chunk_schedule_reference(offsets, num_rows: int, block_m: int, row_lo: int = 0,
                             row_hi: int = ROW_HI_UNBOUNDED, own_pad: bool = True):
    """The kernels' work list in Python: [(expert, row_start, row_end)] in chunk order (expert E = the
    padding rows, zeros). Clamps offsets to [0, T] like the kernels. For tests."""
    ends = [min(max(int(v), 0), num_rows) for v in offsets]
    starts = [0] + ends[:-1]
    ranges = [(s, max(e - s, 0), row_lo < e - s <= row_hi) for s, e in zip(starts, ends)]
    ranges.append((ends[-1], num_rows - ends[-1], own_pad))  # the padding pseudo-expert
    return [(e, s0 + c, min(s0 + c + block_m, s0 + r))
            for e, (s0, r, take) in enumerate(ranges) if take for c in range(0, r, block_m)]


if GLUON_AVAILABLE:

    @gluon.jit
    def _mma_step(acc, words, scale_bytes, x_pairs, a_layout: gl.constexpr, b_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, X_PAIRED: gl.constexpr = False):
        a = decode_a_operand(words, scale_bytes, a_layout, BLOCK_N, BLOCK_K)
        if X_PAIRED:
            xk = x_paired_order(x_pairs, BLOCK_M, BLOCK_K)
        else:
            xk = x_kappa_order(x_pairs, BLOCK_M, BLOCK_K)
        b = gl.convert_layout(xk.permute([1, 0]), b_layout)
        return mma_v2(a, b, acc)

    @gluon.jit
    def x_paired_order(x_pairs, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """Activation pairs already in the paired order (:func:`megamoe.format.mma_order.to_paired_order`: per 8
        elements ``x0 x2 x4 x6 x1 x3 x5 x7``) -> the MMA K order of :func:`decode_a_operand`, moving whole
        32-bit pairs only (no byte permutes)."""
        x = pair_halves(x_pairs).reshape([BLOCK_M, 4, BLOCK_K // 32, 2, 2, 2])  # m, q, i, nib, c1, c0
        return x.permute([0, 2, 3, 4, 1, 5]).reshape([BLOCK_M, BLOCK_K])

    @gluon.jit
    def chunk_rows(chunk, lane, starts, ends, chunks, chunk_ends, BLOCK_M: gl.constexpr):
        """(owner lane, row_start, row_end) of work chunk ``chunk`` (row_end - row_start <= BLOCK_M):
        :func:`locate_tile` with the row end clamped to the chunk."""
        row_start, row_end, owner = locate_tile(chunk, lane, starts, ends, chunks, chunk_ends, BLOCK_M)
        return owner, row_start, gl.minimum(row_end, row_start + BLOCK_M)

    @gluon.jit
    def _partial_offsets(layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """Element offsets of a (BLOCK_N, BLOCK_M) fp32 workspace tile (row-major) in the accumulator layout:
        every thread stores and reloads exactly its own accumulator registers."""
        n_local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        m_local = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        return n_local[:, None] * BLOCK_M + m_local[None, :]

    @gluon.jit
    def _sum_partials(ws_ptr, slot, splits, tile_offs, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """Sum of the ``splits`` partial tiles of work-item ``slot`` in split order 0, 1, .., splits-1 (L2 loads:
        other SMs wrote them)."""
        base = ws_ptr + slot.to(gl.int64) * splits * (BLOCK_N * BLOCK_M) + tile_offs
        acc = gl.load(base, cache_modifier=".cg")
        for s in range(1, splits):
            acc += gl.load(base + s * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
        return acc

    @gluon.jit(do_not_specialize=["num_rows", "num_src_rows", "num_programs", "row_lo", "row_hi", "own_pad",
                                  "splits", "chunk_steps", "slot_chunks"])
    def _nvfp4_mma_decode_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, err_ptr,
        ws_ptr, cnt_ptr,
        num_rows, N, K, num_experts, num_src_rows, swiglu_limit, num_programs, row_lo, row_hi, own_pad,
        splits, chunk_steps, slot_chunks,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_E: gl.constexpr,
        GROUPED: gl.constexpr, HAS_ROW_INDEX: gl.constexpr, HAS_BIAS: gl.constexpr,
        SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr, ERR_FLAG: gl.constexpr, SPLIT: gl.constexpr,
        num_warps: gl.constexpr, STAGES: gl.constexpr = 0, PDL: gl.constexpr = False, X_SMEM: gl.constexpr = False,
        W_IL: gl.constexpr = 1, X_PAIRED: gl.constexpr = False, OUT_PAIRED: gl.constexpr = False,
        EARLY_READS: gl.constexpr = False, AFTER_BAND: gl.constexpr = False,
    ):
        """SPLIT (constexpr; grouped only for 1-3): 0 = no split-K (``ws_ptr``, ``cnt_ptr``, ``splits``,
        ``chunk_steps``, ``slot_chunks`` unused); 1 = split-K with the single-launch ticket reduction;
        2 = split-K partials only; 3 = the reduction only (2 then 3: the two-launch fallback, same bits).
        Split-K: program (pid_n, g, pid_s) takes K steps [pid_s * chunk_steps, +chunk_steps) of each of its
        chunks c < ``slot_chunks``; work item (c, pid_n) owns workspace tiles and counter ``c * n_tiles +
        pid_n``. Chunks at or past ``slot_chunks`` (only a routing beyond the host's hint) and the padding
        chunks are computed whole by the pid_s == 0 program, as with SPLIT 0.
        EARLY_READS (with PDL; register path, SPLIT 0 only): ``expert_offsets``, ``row_index`` and the weights were
        final before the previous kernel started (launcher: ``early_reads``), so a program builds its tile table and
        loads its first chunk's first weight step before it waits for the previous kernel; x loads and every store
        come after the wait.
        AFTER_BAND (with PDL, SPLIT 0; launcher: ``after_band``): a later band of one banded GEMM, whose inputs were
        final before the previous band started and whose rows are disjoint from it: lets the next kernel launch at
        once, computes without waiting, and waits for the previous band only before exiting (what follows on the stream
        then sees every band's rows)."""
        if not EARLY_READS and not AFTER_BAND:
            gl_grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
        if AFTER_BAND:
            gl_launch_dependents()
        gl.static_assert(not EARLY_READS or (SPLIT == 0 and STAGES < 2 and not X_SMEM),
                         "EARLY_READS: the register path without split-K only")
        gl.static_assert(not AFTER_BAND or (PDL and SPLIT == 0 and not EARLY_READS),
                         "AFTER_BAND: a PDL launch without split-K or early reads")
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_layout: gl.constexpr = x_operand_layout(BLOCK_M, BLOCK_K, num_warps)

        pid_n = gl.program_id(0)
        if GROUPED:
            # chunks of BLOCK_M rows of the experts with row_lo < rows <= row_hi (lane E: padding, with own_pad)
            lane, starts, ends, chunks, chunk_ends, total = grouped_tile_table(
                offsets_ptr, num_rows, num_experts, row_lo, row_hi, own_pad, BLOCK_M, BLOCK_E, 1, num_warps)
        else:
            total = (num_rows + BLOCK_M - 1) // BLOCK_M
        if SPLIT != 0:
            pid_s = gl.program_id(2)
            n_tiles = gl.num_programs(0)
            tile_offs = _partial_offsets(mma_layout, BLOCK_N, BLOCK_M)

        # weight rows past N are clamped (re-read), the stores mask them
        n_start = pid_n * BLOCK_N
        w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
        w_cols = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        if W_IL > 1:  # rows interleaved in groups of W_IL per 128-K step (16 words of a row per group run)
            w_offs = interleaved_offsets(w_rows, w_cols, stride_wn, 16, W_IL)
        else:
            w_offs = w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
        s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
        s_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        if W_IL > 1:
            s_offs = interleaved_offsets(s_rows, s_cols, stride_sn, 8, W_IL)
        else:
            s_offs = s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
        x_cols = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, x_layout))
        if STAGES >= 2:
            # weight-stream ring (peer study, benchmarks/NOTES_peer_study.md): the weight words and scale
            # bytes of STAGES - 1 steps ahead are in flight as cp.async copies into shared memory instead of
            # one step in registers. Words: 16-byte copies in the weight layout (read back with the same
            # layout: one LDS.128 per 16 bytes, conflict-free rows of BLOCK_K/2 bytes); scales: one row's
            # BLOCK_K/16 bytes per thread (cp.async needs >= 4 bytes), read back in the scale layout.
            ring_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], ring_layout)
            s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], ring_layout)
            s_copy_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 16], [32, 1], [num_warps, 1], [1, 0])
            sc_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_copy_layout)), N - 1)
            sc_cols = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_copy_layout))
            if W_IL > 1:
                sc_offs = interleaved_offsets(sc_rows, sc_cols, stride_sn, 8, W_IL)
            else:
                sc_offs = sc_rows.to(gl.int64)[:, None] * stride_sn + sc_cols[None, :]

        if X_SMEM:
            # x tiles (already in the MMA K order, megamoe/format/mma_order.py) by cp.async into two shared
            # buffers, one step ahead, read back as the B operand (ldmatrix): no x registers held across steps
            # and no K-order PRMTs (launcher: SPLIT 0, no weight ring)
            xs_ring = gl.allocate_shared_memory(
                gl.bfloat16, [2, BLOCK_M, BLOCK_K],
                gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
            xs_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8],
                                                       [num_warps, 1], [1, 0])
            xs_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, xs_layout))
            x_bf16 = x_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)

        # persistent walk over this n-tile's chunks of at most BLOCK_M rows of one expert
        chunk = gl.program_id(1)
        bad_rows = 0  # row_index values outside [0, num_src_rows) (masked once per chunk, flagged once)
        while chunk < total:
            if GROUPED:
                owner, r0, row_end = chunk_rows(chunk, lane, starts, ends, chunks, chunk_ends, BLOCK_M)
                is_real = owner < num_experts  # lane E: the padding rows, zeros without weight traffic
                expert = gl.minimum(owner, num_experts - 1).to(gl.int64)
            else:
                r0 = chunk * BLOCK_M
                row_end = gl.minimum(num_rows, r0 + BLOCK_M)
                is_real = r0 >= 0
                expert = 0
            if SPLIT == 0:
                k_steps = gl.where(is_real, K // BLOCK_K, 0)
            else:
                split_item = is_real & (chunk < slot_chunks)  # a work item of the workspace / counters
                first = gl.where(split_item, pid_s * chunk_steps, 0)
                k_steps = gl.where(split_item, gl.minimum(K // BLOCK_K - first, chunk_steps),
                                   gl.where(is_real & (pid_s == 0), K // BLOCK_K, 0))
                if SPLIT == 3:
                    k_steps = 0
            last = gl.maximum(k_steps - 1, 0) * BLOCK_K
            w_ptrs = w_ptr + expert * stride_we + w_offs
            s_ptrs = scale_ptr + expert * stride_se + s_offs
            rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
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
            if SPLIT != 0:  # the split's first K element: a multiple of the constexpr BLOCK_K (aligned loads)
                k_begin = first * BLOCK_K
                w_ptrs += k_begin * W_IL // 8
                s_ptrs += k_begin * W_IL // 16
                x_ptrs += k_begin // 2
            x_mask = row_mask[:, None]
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
            if X_SMEM:
                xs_rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xs_layout))
                xs_ok = xs_rows < row_end
                if HAS_ROW_INDEX:  # rows past the chunk read row 0 (never stored); out-of-range values zeros
                    xs_src, _, xs_mask = gathered_source_rows(row_index_ptr, xs_rows, xs_ok, num_src_rows)
                else:
                    xs_src = gl.where(xs_ok, xs_rows, 0).to(gl.int64)
                    xs_mask = None
                xs_ptrs = x_bf16 + xs_src[:, None] * (2 * stride_xm) + xs_cols[None, :]
                gl.thread_barrier()  # every warp has read the previous chunk's buffers
                if k_steps > 0:
                    async_copy.async_copy_global_to_shared(xs_ring.index(0), xs_ptrs, mask=xs_mask)
                async_copy.commit_group()
                words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0, W_IL)
                for step in range(0, k_steps):
                    nxt = gl.minimum((step + 1) * BLOCK_K, last)
                    words_n, scale_n = load_weights(w_ptrs, s_ptrs, nxt, W_IL)
                    async_copy.wait_group(0)  # this thread's copy of `step` has landed
                    gl.thread_barrier()  # everyone's has; everyone has read the other buffer (step - 1)
                    if step + 1 < k_steps:
                        async_copy.async_copy_global_to_shared(xs_ring.index((step + 1) % 2), xs_ptrs + nxt,
                                                               mask=xs_mask)
                    async_copy.commit_group()
                    a = decode_a_operand(words, scale_bytes, a_layout, BLOCK_N, BLOCK_K)
                    b = xs_ring.index(step % 2).permute([1, 0]).load(b_layout)
                    acc = mma_v2(a, b, acc)
                    words, scale_bytes = words_n, scale_n
            elif SPLIT != 3:
                if STAGES >= 2:  # the cp.async ring (launcher: only without split-K)
                    sc_ptrs = scale_ptr + expert * stride_se + sc_offs
                    # every thread has read the previous chunk's last slots before they are refilled
                    gl.thread_barrier()
                    for j in gl.static_range(STAGES - 1):
                        if j < k_steps:
                            async_copy.async_copy_global_to_shared(w_ring.index(j),
                                                                   w_ptrs + j * (W_IL * BLOCK_K // 8))
                            async_copy.async_copy_global_to_shared(s_ring.index(j),
                                                                   sc_ptrs + j * (W_IL * BLOCK_K // 16))
                        async_copy.commit_group()
                    x_pairs = gl.load(x_ptrs, mask=x_mask, other=0)
                    for step in range(0, k_steps):
                        nxt = gl.minimum((step + 1) * BLOCK_K, last)
                        x_next = gl.load(x_ptrs + nxt // 2, mask=x_mask, other=0)
                        async_copy.wait_group(STAGES - 2)  # this thread's copies of `step` have landed
                        gl.thread_barrier()  # everyone's have; everyone has read slot (step - 1) % STAGES
                        ahead = step + STAGES - 1
                        if ahead < k_steps:  # refill the slot read at step - 1; past the end: an empty group
                            slot_a = ahead % STAGES
                            async_copy.async_copy_global_to_shared(w_ring.index(slot_a),
                                                                   w_ptrs + ahead * (W_IL * BLOCK_K // 8))
                            async_copy.async_copy_global_to_shared(s_ring.index(slot_a),
                                                                   sc_ptrs + ahead * (W_IL * BLOCK_K // 16))
                        async_copy.commit_group()
                        slot = step % STAGES
                        words = w_ring.index(slot).load(w_layout)
                        scale_bytes = s_ring.index(slot).load(s_layout)
                        acc = _mma_step(acc, words, scale_bytes, x_pairs, a_layout, b_layout, BLOCK_N, BLOCK_M,
                                        BLOCK_K)
                        x_pairs = x_next
                else:
                    # register double-buffering: step i+1's loads are in flight while step i is decoded;
                    # the load past the end re-reads the last step (in bounds) and is discarded
                    words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0, W_IL)
                    if EARLY_READS:  # x (the previous kernel's output) only after the wait; a no-op after the first
                        gl_grid_dependency_prologue(PDL)
                    x_pairs = gl.load(x_ptrs, mask=x_mask, other=0)
                    for step in range(0, k_steps):
                        nxt = gl.minimum((step + 1) * BLOCK_K, last)
                        words_n, scale_n = load_weights(w_ptrs, s_ptrs, nxt, W_IL)
                        x_next = gl.load(x_ptrs + nxt // 2, mask=x_mask, other=0)
                        acc = _mma_step(acc, words, scale_bytes, x_pairs, a_layout, b_layout, BLOCK_N, BLOCK_M,
                                        BLOCK_K, X_PAIRED)
                        words, scale_bytes, x_pairs = words_n, scale_n, x_next
            if SPLIT == 0:
                # padding rows (the bias included) are zeros
                store_epilogue(acc, r0, row_end, is_real, n_start, N, global_scale_ptr, expert, stride_ge,
                               stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS,
                               SWIGLU, HAS_LIMIT, num_warps, OUT_PAIRED)
            else:
                slot = chunk * n_tiles + pid_n
                if SPLIT != 3:
                    if (~split_item) & (pid_s == 0):  # whole-K chunk (past the slots) or padding zeros
                        store_epilogue(acc, r0, row_end, is_real, n_start, N, global_scale_ptr, expert, stride_ge,
                                       stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N,
                                       HAS_BIAS, SWIGLU, HAS_LIMIT, num_warps, OUT_PAIRED)
                    if split_item:
                        gl.store(ws_ptr + (slot.to(gl.int64) * splits + pid_s) * (BLOCK_N * BLOCK_M) + tile_offs,
                                 acc)
                        if SPLIT == 1:
                            # single-launch reduction (nvfp4_splitk.py): every thread's partial stores precede
                            # the (release) ticket; the last of the item's programs sums the partials in split
                            # order, runs the epilogue and resets the counter for the next launch
                            gl.thread_barrier()
                            ticket = gl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
                            if ticket == splits - 1:
                                total_acc = _sum_partials(ws_ptr, slot, splits, tile_offs, BLOCK_N, BLOCK_M)
                                store_epilogue(total_acc, r0, row_end, is_real, n_start, N, global_scale_ptr,
                                               expert, stride_ge, stride_gn, bias_ptr, out_ptr, stride_om,
                                               swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, SWIGLU, HAS_LIMIT,
                                               num_warps, OUT_PAIRED)
                                gl.store(cnt_ptr + slot, 0)
                else:
                    if split_item:
                        total_acc = _sum_partials(ws_ptr, slot, splits, tile_offs, BLOCK_N, BLOCK_M)
                        store_epilogue(total_acc, r0, row_end, is_real, n_start, N, global_scale_ptr, expert,
                                       stride_ge, stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M,
                                       BLOCK_N, HAS_BIAS, SWIGLU, HAS_LIMIT, num_warps, OUT_PAIRED)
            chunk += num_programs
        if HAS_ROW_INDEX:
            if ERR_FLAG != 0:
                if EARLY_READS:  # a program without chunks has not waited yet: no global write before the wait
                    gl_grid_dependency_prologue(PDL)
                gl.atomic_or(err_ptr, ERR_FLAG, mask=bad_rows > 0)
        if AFTER_BAND:  # complete only after the previous band (the stream's next kernel waits for this one)
            gl_wait_for_previous_grid()


#: The kernel's i32 arguments and its pointers beyond the family's (offline compiles: :func:`compile_for_sm90`, tests).
COMPILE_SCALARS = ["num_rows", "N", "K", "num_experts", "num_programs", "row_lo", "row_hi", "own_pad", "stride_xm",
                   "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ge", "stride_gn", "stride_om", "splits",
                   "chunk_steps", "slot_chunks"]
COMPILE_EXTRA_POINTERS = dict(ws_ptr="*fp32", cnt_ptr="*i32")


def compile_for_sm90(config=MMA_DECODE_CONFIGS[4], *, grouped=True, row_index=True, bias=False, swiglu=False,
                     swiglu_limit=True, split=0, x_smem=False, weight_interleave=1, x_paired=False,
                     out_paired=False):
    """Compile the kernel for sm_90 without a GPU (tests, offline SASS); ``config`` as the launcher's;
    ``split``: the SPLIT mode (0 no split-K, 1 single launch, 2 partials, 3 reduction); ``weight_interleave``: as
    the launcher's (its ``W_IL`` and register cap)."""
    stages = config[4] if len(config) > 4 else 0
    interleave = interleave_constants(config, stages, weight_interleave)
    maxnreg = interleave.pop("maxnreg", None)
    return compile_sm90(_nvfp4_mma_decode_kernel, COMPILE_SCALARS, config[:3], config[3], grouped=grouped,
                        row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                        extra_signature=COMPILE_EXTRA_POINTERS,
                        extra_constants=dict(SPLIT=split, STAGES=stages, X_SMEM=x_smem, X_PAIRED=x_paired,
                                             OUT_PAIRED=out_paired, **interleave),
                        maxnreg=maxnreg)


def plan_decode_splits(items: int, k: int, block_k: int, num_sms: int, splits: int | None = None) -> tuple[int, int]:
    """(S, K steps per split) of the grouped decode split-K, from host values only.

    ``items``: host bound on the real work items (chunks x n-tiles); ``splits``: None plans
    ``S = cdiv(num_sms * DECODE_SPLITK_PROGRAMS_PER_SM, items)`` capped by DECODE_SPLITK_MAX_SPLITS and
    by DECODE_SPLITK_MIN_STEPS steps per split; an int forces S (benchmarks). Every split is non-empty
    (the last may be shorter); S = 1 means no split-K.
    """
    k_steps = max(1, k // block_k)
    if splits is None:
        target = num_sms * DECODE_SPLITK_PROGRAMS_PER_SM
        splits = min(-(-target // max(1, items)), DECODE_SPLITK_MAX_SPLITS, k_steps // DECODE_SPLITK_MIN_STEPS)
    splits = max(1, min(int(splits), k_steps))
    per = -(-k_steps // splits)
    return -(-k_steps // per), per


def split_schedule_reference(items: list, num_experts: int, n_tiles: int, splits: int, chunk_steps: int,
                             k_steps: int, slot_chunks: int):
    """The split-K kernel's work in Python, for tests. ``items``: :func:`chunk_schedule_reference`'s list
    (expert ``num_experts`` = padding). Returns (summed, whole): summed maps a work item's slot
    ``chunk * n_tiles + n-tile`` to [(split, first K step, steps)] in the order the reduction adds them;
    whole lists the (chunk, n-tile) that the split-0 program computes over the whole K (chunks past
    ``slot_chunks``) or writes as zeros (padding)."""
    summed, whole = {}, []
    for chunk, (expert, _, _) in enumerate(items):
        for n in range(n_tiles):
            if expert < num_experts and chunk < slot_chunks:
                summed[chunk * n_tiles + n] = [(s, s * chunk_steps, max(0, min(k_steps - s * chunk_steps, chunk_steps)))
                                               for s in range(splits)]
            else:
                whole.append((chunk, n))
    return summed, whole


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
    error_word: torch.Tensor | None = None,
    row_band: tuple[int, int] = (0, ROW_HI_UNBOUNDED),
    own_pad: bool = True,
    max_rows_per_expert: int | None = None,
    splits: int | None = 1,
    x_smem=None,
    weight_interleave: int = 1,
    x_paired: bool = False,
    out_paired: bool = False,
    early_reads: bool = False,
    after_band: bool = False,
) -> torch.Tensor:
    """Launch the decode-shaped tensor-core NVFP4 GEMM (inputs validated by ``megamoe.ops.gemm``).

    Same contract as :func:`megamoe.kernels.gemm.nvfp4_gemm.launch_nvfp4_gemm`;
    additionally ``gluon_supports(x, data)`` must hold (sm_90, K % 128 == 0,
    16-byte aligned rows). ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps[, stages]),
    else :func:`select_mma_decode_config`. ``interpreter`` must be False.
    Grouped only: ``row_band`` (lo, hi): compute only the experts with
    ``lo < rows <= hi`` (their output rows; other experts' rows are left
    untouched); ``own_pad``: write zeros to the padding rows ``[offsets[E-1], T)``;
    ``max_rows_per_expert``: host hint that sizes the grid (never affects results).
    ``splits`` (grouped only): K splits per work item; 1 (default) = no split-K, None = planned from
    host shapes (:func:`plan_decode_splits`), an int > 1 forces it. With S > 1 the partial sums go to an
    fp32 workspace and the last program of each work item reduces them in split order (deterministic;
    equal to S = 1 up to fp32 summation order); the tile counters are ``nvfp4_splitk.splitk_counters``.
    ``x_smem``: the BLOCK_M values that stream x through shared memory (default :data:`MMA_X_SMEM_BLOCK_M`;
    without split-K and the weight ring only); the same MMAs in the same K order, so the same bits.
    ``weight_interleave`` (1 or 4): ``data`` and ``block_scale`` hold groups of that many rows interleaved per 128-K
    step (:func:`megamoe.format.layouts.interleave_weight_rows`); the same bits as the row-major layout.
    ``x_paired``: ``x`` is already in the paired order (:func:`megamoe.format.mma_order.to_paired_order`), so the
    kernel feeds its pairs to the MMA without byte permutes (register path only: no x_smem, no weight ring); the
    same MMAs in the same K order, so the same bits as the plain ``x``.
    ``out_paired`` (``swiglu`` only, N // 2 a multiple of 8): the SwiGLU output is written in the paired order (the
    next GEMM's ``x_paired`` input).
    ``early_reads``: ``expert_offsets``, ``row_index`` (and the weights) were written before the kernel that writes
    ``x`` started (a MoE layer's down GEMM: the routing precedes gate_up). Where this launch uses PDL, the register
    path without split-K, and :func:`megamoe.kernels.pdl.pdl_early_reads` allows it, each program then builds its tile
    table and loads its first weight step before it waits for the previous kernel (the same bits).
    ``after_band``: this launch is a later band of one banded GEMM (:func:`megamoe.ops.gemm.plan_row_bands`; its
    inputs final before the previous band started, its rows disjoint): on a PDL-capable device and without split-K it
    is launched with PDL, runs beside the previous band and waits for it only before exiting (the same bits).
    """
    if interpreter:
        raise ValueError("interpreter: the Gluon kernels run on sm_90 GPUs only")
    check_weight_interleave(weight_interleave, data)
    grouped = expert_offsets is not None
    num_rows = out.shape[0]
    n, k = data.shape[-2], 2 * data.shape[-1]
    num_experts = data.shape[0] if grouped else 1
    if num_rows == 0 or n == 0:
        return out
    rows_per_expert = triton.cdiv(num_rows, min(num_experts, num_rows)) if grouped else num_rows
    config = tuple(config or select_mma_decode_config(rows_per_expert, k))
    block_m, block_n, block_k, num_warps = config[:4]
    stages = config[4] if len(config) > 4 else 0
    if k % block_k or (weight_interleave > 1 and block_k % 128):
        raise ValueError(f"data: K={k} must be a multiple of BLOCK_K={block_k} for this kernel (and BLOCK_K of 128 "
                         "with weight_interleave)")
    row_lo, row_hi = row_band if grouped else (0, ROW_HI_UNBOUNDED)
    if grouped:
        chunks = chunk_bound(num_rows, num_experts, block_m, row_lo, row_hi, own_pad, max_rows_per_expert)
    else:
        chunks = triton.cdiv(num_rows, block_m)
    x_smem = MMA_X_SMEM_BLOCK_M if x_smem is None else x_smem
    if out_paired and (not swiglu or (n // 2) % 8):
        raise ValueError(f"out_paired: the paired output needs swiglu and N // 2 a multiple of 8, got swiglu={swiglu}, "
                         f"N={n}")
    if x_paired and (stages or block_m in x_smem):
        raise ValueError("x_paired: the paired x order is read by the register path only (no x_smem, no weight ring)")
    if MMA_X_PAIRED and not x_paired and stages == 0 and block_m not in x_smem:
        from ...format.mma_order import to_paired_order

        x, x_paired = to_paired_order(x), True
    head, strides, flags = kernel_arguments(x, data, block_scale, global_scale, out, expert_offsets=expert_offsets,
                                            row_index=row_index, bias=bias, swiglu=swiglu, swiglu_limit=swiglu_limit,
                                            error_word=error_word)
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  BLOCK_E=max(32 * num_warps, triton.next_power_of_2(num_experts + 1)) if grouped else 32 * num_warps,
                  num_warps=num_warps, **flags)
    consts["STAGES"] = ring_stages(stages, block_scale.data_ptr(), strides[3:5])
    n_tiles = triton.cdiv(n, block_n)
    num_sms = _num_sms(x.device.index or 0)
    if grouped and splits != 1:
        real = chunk_bound(num_rows, num_experts, block_m, row_lo, row_hi, False, max_rows_per_expert)
        splits, chunk_steps = plan_decode_splits(real * n_tiles, k, block_k, num_sms, splits)
    else:
        splits, chunk_steps = 1, k // block_k
    ws = cnt = out
    mode = 0
    if splits > 1:
        from .nvfp4_splitk import COUNTER_SLOTS, splitk_counters  # (nvfp4_splitk imports this module)

        # slots: chunk * n_tiles + n-tile for the chunks below the host bound (the pseudo-expert's included)
        slot_chunks = min(chunks, COUNTER_SLOTS // n_tiles)
        ws = torch.empty(slot_chunks * n_tiles * splits * block_n * block_m, dtype=torch.float32, device=x.device)
        cnt = splitk_counters(x.device)
        mode = 1 if cnt is not None else 2
        if cnt is None:  # capturing before any eager launch: partials, then a reduction launch (same bits)
            cnt = ws
    else:
        slot_chunks = 0
    if splits > 1:  # the ring reads whole-K slabs from the chunk's start: split-K keeps register buffering
        consts["STAGES"] = 0
    consts.update(interleave_constants(config, consts["STAGES"], weight_interleave))
    consts["X_SMEM"] = block_m in x_smem and splits == 1 and consts["STAGES"] == 0
    consts["X_PAIRED"] = bool(x_paired)
    consts["OUT_PAIRED"] = bool(out_paired)
    if consts["X_SMEM"]:  # x in the kernel's MMA K order (a (S, K) temporary), streamed by cp.async
        x32 = launch_to_mma_k_order(x, block_k=block_k).view(torch.int32)
        head = (x32, *head[1:])
        strides = (x32.stride(0), *strides[1:])
    pointers, scalars = head[:9], head[9:]

    def arguments(num_programs):
        return (*pointers, ws, cnt, *scalars, num_programs, row_lo, row_hi, int(own_pad), splits, chunk_steps,
                slot_chunks, *strides)

    args = arguments(1)
    consts["SPLIT"] = mode
    if splits > 1:  # several waves on purpose (probe_stream.md): every chunk of the host bound has its programs
        grid = (n_tiles, max(1, chunks), splits)
    else:
        resident = compiled_residency(_nvfp4_mma_decode_kernel, (n_tiles, 1, 1), args, consts)
        grid = (*mma_decode_grid(num_sms, resident, n, chunks, block_n), 1)
    # PDL launch only where no program loops (pdl.PDL_LAUNCH): the host chunk bound within the programs per n-tile
    consts["PDL"], launch_pdl = pdl_flags(x, "mma_decode", single_pass=splits == 1 and chunks <= grid[1])
    consts["AFTER_BAND"] = after_band and mode == 0 and pdl_supported(x)
    if consts["AFTER_BAND"]:
        consts["PDL"] = launch_pdl = True
    consts["EARLY_READS"] = (early_reads and launch_pdl and pdl_early_reads("mma_decode") and mode == 0
                             and consts["STAGES"] < 2 and not consts["X_SMEM"] and not consts["AFTER_BAND"])
    _nvfp4_mma_decode_kernel[grid](*arguments(grid[1]), **consts, launch_pdl=launch_pdl)
    if mode == 2:
        consts["SPLIT"] = 3
        _nvfp4_mma_decode_kernel[(grid[0], grid[1], 1)](*arguments(grid[1]), **consts, launch_pdl=launch_pdl)
    return out
