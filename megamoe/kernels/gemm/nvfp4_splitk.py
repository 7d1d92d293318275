"""Dense NVFP4 x bf16 GEMMs at decode sizes (M = 1..256) with split-K: the whole GPU for small N.

One kernel family, one launcher (:func:`launch_nvfp4_splitk`).

Why: a dense decode GEMM (``x (M, K) @ W^T``, W (N, K) NVFP4) streams N*K*9/16
weight bytes once. The other kernels give one program per BLOCK_N weight rows
and the full K, i.e. 16-64 programs for N = 1024-4096 on a 132-SM H100, which
cannot stream at the HBM rate. Here the grid is ``(cdiv(N, BLOCK_N), splits)``:
program ``(j, s)`` owns weight rows ``[j*BLOCK_N, (j+1)*BLOCK_N)`` and the K range
``[s*k_chunk, min(K, (s+1)*k_chunk))`` (``k_chunk`` a multiple of BLOCK_K, so
only the last split can end on a ragged step; K need only be a multiple of 16),
and ``splits`` is chosen on the host from (M, N, K) alone so that the grid fills
one wave of the GPU (:func:`plan_splitk`).

Four kernels:

* ``_splitk_partial_kernel`` (Triton; also runs in the interpreter): the K-slice
  partial sums, either on CUDA cores (``USE_DOT=False``: the exact decode and
  fp32 FMA step of ``nvfp4_gemv.py``, ROWS token rows per pass; for M <= 4) or
  through ``tl.dot`` (``USE_DOT=True``: the decode + swap-AB dot step of
  ``nvfp4_gemm.py``; the portable tensor-core path).
* ``_splitk_mma_kernel`` (Gluon, sm_90 only): the same partial sums with the
  FP4 words decoded straight into ``mma.sync`` A-operand registers (the building
  blocks of ``nvfp4_gluon_jit.py`` / ``nvfp4_mma_decode.py``; ~3.2 instructions
  per weight); used for 8 <= M <= 16 when K % 128 == 0.
* ``_splitk_wgmma_kernel`` (Gluon, sm_90 only, ``kind = "wgmma"``): the wgmma
  step of ``nvfp4_wgmma.py`` (weights decoded into the A registers, swap-AB,
  the x^T tile through shared memory) for 16 < M <= 256: one program owns
  BLOCK_M = 32..128 token rows, so at M <= 64 (128) one weight pass serves
  every row; a third grid axis takes further BLOCK_M row tiles (its programs
  are launched next to each other and share the weight slice through L2).
* ``_splitk_reduce_kernel`` (Triton): ``out = bf16(sum_s partial[s] *
  global_scale * 2**8 + bias)``, summing the splits in index order; the
  fallback of the single-launch reduction below, and the only reduction of a
  SwiGLU launch (``swiglu``: gate/up column pairs -> one bf16 output column).

**Single launch, deterministic reduction** (``FUSED``). Partial sums go to a
float32 workspace ``(splits, M, N)`` taken from the caching allocator on every
call. Each program stores its partial, then (after a CTA barrier) takes a
ticket with one ``atomic_add(acq_rel, gpu scope)`` on the counter of its
output tile; the program that draws ticket ``splits - 1`` is the last one,
sums the tile's partials in split-index order ``0, 1, .., splits-1`` (loads
from L2, ``.cg``), applies ``global_scale * 2**8`` and bias, writes bf16, and
stores 0 back into the counter. The sum order does not depend on which
program arrives last, so the bits are the same on every run, eager or graph
replay, and equal to the two-launch path's (same operations, same order).

**Counter workspace** (:func:`splitk_counters`): one int32 vector of
:data:`COUNTER_SLOTS` zeros per device, allocated on the first launch outside
CUDA-graph capture and cached for the life of the process (a captured graph
keeps its address). Every launch leaves it all-zero again (each tile's last
program resets its counter), so graphs replay and eager calls interleave
freely. Two split-K launches on *different streams of one device* must not
run concurrently (they would share tile counters); a launch while a graph is
being captured before any eager launch on that device, or one with more tiles
than :data:`COUNTER_SLOTS`, falls back to the two-launch reduction (same bits).

With one split the partial kernels write bf16 directly (global scale and bias
in their epilogue) and no workspace or counter is used.

Decoded weights carry a factor ``2**-8`` (see ``nvfp4_jit``), undone with the
global scale (0-d or per row (N, 1)) in the final epilogue.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .nvfp4_gemm import _load_weight_step, _mma_step, global_scale_strides, swiglu_clamped
from .nvfp4_gemv import _fma_k_loop, _load_step
from .nvfp4_gluon_jit import GLUON_AVAILABLE, gluon_supports
from ..nvfp4_jit import round_to_bf16
from ..pdl import grid_dependency_prologue, pdl_early_reads, pdl_flags

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .nvfp4_gluon_jit import (
        load_weights,
        scale_layout,
        store_epilogue,
        weight_layout,
        wgmma_k_loop,
        x_operand_layout,
        x_split_layout,
    )
    from .nvfp4_mma_decode import _mma_step as _gluon_mma_step
    from ..pdl import gl_grid_dependency_prologue

# ---------------------------------------------------------------------------
# Tile configurations. Key: upper bound on M (the first key >= M wins).
# Values: (kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs_per_sm, maxnreg)
#   kind: "fma" (Triton CUDA-core step, BLOCK_M = ROWS rows per pass), "dot" (Triton tl.dot step),
#     "mma" (Gluon mma.sync step, BLOCK_M rows per pass), "wgmma" (Gluon wgmma step, BLOCK_M rows per
#     program, BLOCK_N = 16 * num_warps, BLOCK_M >= 8 * num_warps); the Gluon kinds fall back to "dot"
#     when Gluon cannot run the shape.
#   programs_per_sm: resident programs per SM the split count aims for (one full wave).
#   maxnreg: register cap (None: the compiler's choice).
# fma rows: the nvfp4_gemv configs measured in gemm_v5; mma rows: the nvfp4_mma_decode configs of gemm_v6;
# measured as the split-K kernel on an H200 in gemm_dense_splitk_20261123_1435 (M = 1, 8: 1.1-1.9x bf16).
# wgmma rows (v13): not yet measured; BLOCK_M covers M <= 64 in one program (one weight pass), 128 rows
# need 8 warps (two warpgroups) to keep the x operand in registers (NOTES_gemm.md, v13).
# ---------------------------------------------------------------------------
SPLITK_CONFIGS = {
    1: ("fma", 1, 64, 256, 4, 4, 128),
    2: ("fma", 2, 64, 256, 4, 3, 168),
    4: ("fma", 4, 32, 128, 2, 8, None),
    8: ("mma", 8, 128, 256, 4, 3, None),
    16: ("mma", 16, 128, 128, 4, 2, None),
    32: ("wgmma", 32, 64, 128, 4, 3, None),
    64: ("wgmma", 64, 64, 128, 4, 2, None),
    1 << 62: ("wgmma", 128, 128, 128, 8, 1, None),
}
# Per shape class (:func:`dense_shape_class`), the entries that replace SPLITK_CONFIGS' (same keys). Measured on
# the H100 (gemm_dense_v13 sweep): at M = 64 on the bandwidth-bound class, 8 warps x 128 columns per program
# (one program per SM) beat the 4-warp 64-column tile: 18432x7168 96.0 -> 86.0 us, 32768x1024 26.5 -> 19.5 us.
# (At M = 1 on the "huge" class, 8 FMA programs per SM had beaten 4 (18432x7168 41.0 -> 37.7 us, gpu_check_v21); the
# mma.sync kind below replaced both.)
# At M = 1 / 2 / 4 the mma.sync kind (one weight pass for up to 8 rows, 3.1 instructions per weight) against the FMA
# kind (one pass per row group, 5.3 per weight): H100, graph replay, results/gpu_check_v36/sweep_dense_m1_e.md, us per
# call, FMA -> mma: 18432x7168 37.6 / 52.0 / 76.7 -> 34.9 / 35.2 / 36.0 (BLOCK_N 128, 3 per SM); 32768x1024 11.0 / 14.7
# / 17.6 -> 10.9 / 11.1 / 12.0 and 4096x8192 12.7 / 15.2 / 20.2 -> 12.1 / 12.3 / 13.8 (BLOCK_N 64, 4 per SM at 128
# registers); the small class from M = 2 (4096x4096 10.0 / 12.6 -> 9.0 / 10.0, 1024x4096 6.8 / 8.6 -> 6.8 / 6.8) but not
# at M = 1 (1024x4096 6.4 FMA vs 6.8).
MMA_SMALL_M_CONFIG = ("mma", 8, 64, 256, 4, 4, 128)
MMA_SMALL_M_HUGE_CONFIG = ("mma", 8, 128, 256, 4, 3, None)
SPLITK_CLASS_CONFIGS = {
    "small": {2: MMA_SMALL_M_CONFIG, 4: MMA_SMALL_M_CONFIG},
    "large": {1: MMA_SMALL_M_CONFIG, 2: MMA_SMALL_M_CONFIG, 4: MMA_SMALL_M_CONFIG,
              64: ("wgmma", 64, 128, 128, 8, 1, None)},
    "huge": {1: MMA_SMALL_M_HUGE_CONFIG, 2: MMA_SMALL_M_HUGE_CONFIG, 4: MMA_SMALL_M_HUGE_CONFIG,
             64: ("wgmma", 64, 128, 128, 8, 1, None)},
}
# The single-launch reduction (the last-arriving program sums the splits) only up to this many rows: above it,
# one program reducing splits x BLOCK_M x BLOCK_N values serially cost more than the second launch (gemm_dense_v13
# sweep, H100: 1024x4096 M = 16 13.9 us single vs 8.0 two-launch; M = 1 single 0.3-0.5 us faster; M = 8 even).
FUSED_MAX_ROWS = 8
# Offline sm_90 compile (ptxas, tests/kernels/gemm/test_nvfp4_splitk.py), registers / K-loop SASS per weight:
# fma 1 row 127-128 regs, 5.3 instr/weight; fma 2 rows 164-168; fma 4 rows (2 warps) 123-127;
# mma 8 rows 128-135 regs, 3.1 instr/weight; mma 32 rows 225-227 regs; no spills in any K loop.
# v13 (single-launch reduction and the wgmma kind): see NOTES_gemm.md, v13 (registers / spills table).
# the portable tensor-core step, when the Gluon kernels cannot run the shape (K % 128, alignment)
DOT_FALLBACK = ("dot", 16, 64, 128, 4, 2, None)
# Interpreter (CPU tests): tiny tiles so that the N/K edges, split edges and row loops are exercised.
INTERPRETER_CONFIGS = {
    "fma": ("fma", 2, 16, 64, 4, 1, None),
    "dot": ("dot", 16, 16, 64, 4, 1, None),
}
INTERPRETER_PROGRAMS = 12  # "SM count" the interpreter plans for (splits > 1 at test sizes)
# The fp32 workspace (splits * M * N * 4 bytes, written once and read once by the reduction) is
# meant to stay in the 50 MB L2: at most WORKSPACE_L2_BYTES, and at most WORKSPACE_WEIGHT_RATIO
# times the weight bytes N*K*9/16.
WORKSPACE_L2_BYTES = 16 << 20
WORKSPACE_WEIGHT_RATIO = 1.0
# Tile counters of the single-launch reduction: int32 slots per device (64 KB); a launch with more
# output tiles (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) for "wgmma", cdiv(N, BLOCK_N) otherwise) uses the
# two-launch reduction.
COUNTER_SLOTS = 1 << 14
_COUNTERS: dict = {}


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _first_bound(table: dict, m: int):
    for bound, config in sorted(table.items()):
        if m <= bound:
            return config
    raise AssertionError("unreachable: the last bound is unbounded")


def select_splitk_config(m: int, interpreter: bool, gluon_ok: bool, n: int | None = None, k: int | None = None):
    """(kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, programs_per_sm, maxnreg) for M rows of an (N, K) weight
    (:data:`SPLITK_CLASS_CONFIGS` overrides per shape class when N, K are given); the interpreter runs the
    Triton kinds only ("fma" up to 4 rows, "dot" above). Where Gluon cannot run the shape (``gluon_ok`` False), a
    Gluon kind falls back to :data:`SPLITK_CONFIGS`' entry for M if that is a Triton kind, else to
    :data:`DOT_FALLBACK`."""
    if interpreter:
        return INTERPRETER_CONFIGS["fma" if m <= 4 else "dot"]
    table = SPLITK_CONFIGS
    if n is not None and k is not None:
        table = {**SPLITK_CONFIGS, **SPLITK_CLASS_CONFIGS.get(dense_shape_class(n, k)[0], {})}
    config = _first_bound(table, m)
    if config[0] in ("mma", "wgmma") and not gluon_ok:
        config = _first_bound(SPLITK_CONFIGS, m)
        if config[0] in ("mma", "wgmma"):
            config = DOT_FALLBACK
    return config


def default_single_launch(num_rows: int) -> bool:
    """Whether a launch of ``num_rows`` rows reduces in one launch by default (``fused=None``): the last program of a
    tile sums the splits, drawing tickets on the device's tile counters (:func:`splitk_counters`), which concurrent
    split-K launches would share. Above :data:`FUSED_MAX_ROWS` rows the reduction is a second launch, no counters."""
    return num_rows <= FUSED_MAX_ROWS


def splitk_counters(device) -> torch.Tensor | None:
    """The (COUNTER_SLOTS,) int32 tile counters of ``device`` (zeros; every launch leaves them zero).

    Allocated on first use and cached per device for the life of the process. While the current stream
    is capturing a CUDA graph and no counters exist yet, returns None (a zero-fill recorded in the graph
    would not run for eager calls): the launcher then uses the two-launch reduction.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def plan_splitk(m: int, n: int, k: int, block_n: int, block_k: int, target_programs: int) -> tuple[int, int]:
    """(splits, k_chunk) from host shapes only: enough K splits that ``cdiv(N, BLOCK_N) * splits``
    reaches ``target_programs`` (one wave), at most one split per K step, and a workspace within
    :data:`WORKSPACE_L2_BYTES` and :data:`WORKSPACE_WEIGHT_RATIO` times the weight bytes. ``k_chunk`` is a
    multiple of ``block_k``; every split is non-empty (the last may be shorter)."""
    n_tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    splits = max(1, min((2 * target_programs + n_tiles) // (2 * n_tiles), k_steps))  # round(target / n_tiles)
    ws_cap = int(min(WORKSPACE_L2_BYTES, WORKSPACE_WEIGHT_RATIO * n * k * 9 / 16) // (4 * max(m, 1) * n))
    splits = max(1, min(splits, ws_cap))
    steps_per_split = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, steps_per_split)
    return splits, steps_per_split * block_k


@triton.jit
def _epilogue_store(acc, rows, row_mask, cols, col_mask, N, global_scale_ptr, stride_gn, bias_ptr, out_ptr,
                    stride_om, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """acc (R, C) fp32 (weights carry 2**-8) -> bf16(acc * global_scale * 2**8 + bias) at out[rows, cols]."""
    gscale = tl.load(global_scale_ptr + tl.minimum(cols, N - 1).to(tl.int64) * stride_gn) * 256.0
    acc = acc * gscale[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], round_to_bf16(acc, INTERPRET),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _store_partial(acc, rows, row_mask, cols, col_mask, pid_k, num_rows, N, global_scale_ptr, stride_gn, bias_ptr,
                   out_ptr, stride_om, ws_ptr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) fp32 (weights carry 2**-8) -> bf16 out (DIRECT) or workspace[pid_k]."""
    if DIRECT:
        _epilogue_store(acc, rows, row_mask, cols, col_mask, N, global_scale_ptr, stride_gn, bias_ptr, out_ptr,
                        stride_om, HAS_BIAS, INTERPRET)
    else:
        base = ws_ptr + (pid_k * num_rows).to(tl.int64) * N
        tl.store(base + rows.to(tl.int64)[:, None] * N + cols[None, :], acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _last_program_reduces(ws_ptr, cnt_ptr, slot, splits, num_rows, cols, col_mask, N, global_scale_ptr, stride_gn,
                          bias_ptr, out_ptr, stride_om, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                          INTERPRET: tl.constexpr):
    """Single-launch reduction (module docstring): after this program's partials are stored, draw a
    ticket on counter ``slot``; the last of the ``splits`` programs sums workspace[0..splits-1] of its
    column tile in index order, writes bf16 and resets the counter to 0."""
    tl.debug_barrier()  # every thread's partial stores precede the (release) ticket
    ticket = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        offs_r = tl.arange(0, BLOCK_M)
        r0 = slot * 0
        while r0 < num_rows:
            rows = r0 + offs_r
            row_mask = rows < num_rows
            mask = row_mask[:, None] & col_mask[None, :]
            ptrs = ws_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            s = slot * 0 + 1  # a while loop: the interpreter cannot range() over a runtime bound
            while s < splits:
                acc += tl.load(ptrs + (s * num_rows).to(tl.int64) * N, mask=mask, other=0.0, cache_modifier=".cg")
                s += 1
            _epilogue_store(acc, rows, row_mask, cols, col_mask, N, global_scale_ptr, stride_gn, bias_ptr, out_ptr,
                            stride_om, HAS_BIAS, INTERPRET)
            r0 += BLOCK_M
        tl.store(cnt_ptr + slot, 0)  # every program of this tile has drawn its ticket: ready for the next launch


@triton.jit
def _fma_x_ptrs(x_ptr, rows, stride_xm, k_begin, offs_w, offs_q):
    """x as int32 bf16 pairs, (ROWS, 1, BLOCK_K // 8, 4): weight word j pairs with x words 4j..4j+3 (nvfp4_gemv)."""
    return (x_ptr + rows.to(tl.int64)[:, None, None, None] * stride_xm
            + (k_begin // 2 + 4 * offs_w)[None, None, :, None] + offs_q[None, None, None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _splitk_partial_kernel(
    x_ptr, w_ptr, scale_ptr, global_scale_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    num_rows, N, K, chunk_steps, splits, stride_xm, stride_wn, stride_sn, stride_gn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    DIRECT: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr = False, EARLY_READS: tl.constexpr = False,
):
    """Partial sums of weight rows [pid_n*BLOCK_N, +BLOCK_N) over the K range of split pid_k; with FUSED
    the last of the ``splits`` programs of the column tile also reduces them (counter ``cnt_ptr[pid_n]``).

    USE_DOT False: x_ptr / w_ptr are int32 views (bf16 pairs, 4 packed bytes), stride_xm / stride_wn in
    words; BLOCK_M is the ROWS of the CUDA-core step. USE_DOT True: bf16 x and uint8 packed weights.
    PDL: the prologue (megamoe/kernels/pdl.py). EARLY_READS (launcher: CUDA-core step, EVEN_K, num_rows <= BLOCK_M,
    so one row pass; the caller vouched that the weights were final before the previous kernel started): the first
    weight step is loaded before the PDL wait, x and everything else after it.
    """
    if not EARLY_READS:
        grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # k_begin as a multiple of the constexpr BLOCK_K, so that the compiler can prove the
    # 16-byte alignment of the slice's weight words (vectorised loads)
    k_begin = pid_k * chunk_steps * BLOCK_K
    k_len = tl.minimum(K - k_begin, chunk_steps * BLOCK_K)  # > 0: the host plans non-empty splits
    k_steps = (k_len + BLOCK_K - 1) // BLOCK_K

    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = pid_n * BLOCK_N + offs_n
    col_mask = cols < N
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)  # clamp instead of masking the weight loads

    if USE_DOT:
        offs_k = tl.arange(0, BLOCK_K)
        offs_h = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 16)
        w_ptrs = w_ptr + w_cols[:, None] * stride_wn + (k_begin // 2 + offs_h)[None, :]
        s_ptrs = scale_ptr + w_cols[:, None] * stride_sn + (k_begin // 16 + offs_g)[None, :]
    else:
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, BLOCK_K // 16)
        offs_q = tl.arange(0, 4)
        w_ptrs = w_ptr + w_cols[None, :, None] * stride_wn + (k_begin // 8 + offs_w)[None, None, :]
        s_ptrs = scale_ptr + w_cols[None, :, None] * stride_sn + (k_begin // 16 + offs_g)[None, None, :]

    if EARLY_READS:
        tl.static_assert(not USE_DOT and EVEN_K, "EARLY_READS: the CUDA-core step with K % BLOCK_K == 0")
        words_e = tl.load(w_ptrs)
        scale_e = tl.load(s_ptrs)
        grid_dependency_prologue(PDL)  # x, the workspace, the counters and out only after the wait
        row_mask = offs_r < num_rows
        x_ptrs = _fma_x_ptrs(x_ptr, offs_r, stride_xm, k_begin, offs_w, offs_q)
        x_mask = row_mask[:, None, None, None]
        xt = tl.load(x_ptrs, mask=x_mask, other=0)
        acc = _fma_k_loop(words_e, scale_e, xt, w_ptrs, s_ptrs, x_ptrs, x_mask, k_len, k_steps, BLOCK_M, BLOCK_N,
                             BLOCK_K, EVEN_K, INTERPRET)
        _store_partial(acc, offs_r, row_mask, cols, col_mask, pid_k, num_rows, N, global_scale_ptr, stride_gn,
                       bias_ptr, out_ptr, stride_om, ws_ptr, DIRECT, HAS_BIAS, INTERPRET)
    else:
        r0 = pid_n * 0  # a tensor: loop-carried below
        while r0 < num_rows:
            rows = r0 + offs_r
            row_mask = rows < num_rows
            if USE_DOT:
                x_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + (k_begin + offs_k)[:, None]
                acc_nm = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                if INTERPRET:
                    kt = 0
                    while kt < k_steps:
                        pa, sa = _load_weight_step(w_ptrs, s_ptrs, kt, col_mask, k_len, BLOCK_K, EVEN_K, True)
                        acc_nm = _mma_step(acc_nm, pa, sa, kt, x_ptrs, row_mask, k_len, BLOCK_N, BLOCK_K, True,
                                           EVEN_K, True)
                        kt += 1
                else:
                    for kt in range(0, k_steps):
                        pa, sa = _load_weight_step(w_ptrs, s_ptrs, kt, col_mask, k_len, BLOCK_K, EVEN_K, True)
                        acc_nm = _mma_step(acc_nm, pa, sa, kt, x_ptrs, row_mask, k_len, BLOCK_N, BLOCK_K, True,
                                           EVEN_K, False)
                acc = tl.trans(acc_nm)
            else:
                x_ptrs = _fma_x_ptrs(x_ptr, rows, stride_xm, k_begin, offs_w, offs_q)
                x_mask = row_mask[:, None, None, None]
                words, scale_bytes, xt = _load_step(w_ptrs, s_ptrs, x_ptrs, x_mask, 0, k_len, BLOCK_K, EVEN_K)
                acc = _fma_k_loop(words, scale_bytes, xt, w_ptrs, s_ptrs, x_ptrs, x_mask, k_len, k_steps, BLOCK_M,
                                     BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
            _store_partial(acc, rows, row_mask, cols, col_mask, pid_k, num_rows, N, global_scale_ptr, stride_gn,
                           bias_ptr, out_ptr, stride_om, ws_ptr, DIRECT, HAS_BIAS, INTERPRET)
            r0 += BLOCK_M
    if FUSED:
        _last_program_reduces(ws_ptr, cnt_ptr, pid_n, splits, num_rows, cols, col_mask, N, global_scale_ptr,
                              stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M, HAS_BIAS, INTERPRET)


@triton.jit
def _swiglu_epilogue_store(acc, rows, row_mask, col_start, N, global_scale_ptr, stride_gn, bias_ptr, out_ptr,
                           stride_om, swiglu_limit, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_LIMIT: tl.constexpr, INTERPRET: tl.constexpr, WEIGHT_SCALE: tl.constexpr = 256.0):
    """acc (R, BLOCK) fp32 over columns ``col_start..`` of the interleaved gate/up layout (column 2j gate j, 2j + 1
    up j; BLOCK and col_start even) -> out[rows, col_start // 2 + j] = bf16(silu(min(gate, limit)) *
    clamp(up, -limit, limit)) after the global scale (times ``WEIGHT_SCALE``: 2**8 undoes the 2**-8 the decoded
    weights carry) and bias, with the Triton GEMM kernels' SwiGLU (``nvfp4_gemm.swiglu_clamped``)."""
    cols = col_start + tl.arange(0, BLOCK)
    col_mask = cols < N
    gscale = tl.load(global_scale_ptr + tl.minimum(cols, N - 1).to(tl.int64) * stride_gn) * WEIGHT_SCALE
    acc = acc * gscale[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc, (acc.shape[0], BLOCK // 2, 2)))
    y = swiglu_clamped(gate, up, swiglu_limit, HAS_LIMIT)
    half_cols = col_start // 2 + tl.arange(0, BLOCK // 2)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + half_cols[None, :], round_to_bf16(y, INTERPRET),
             mask=row_mask[:, None] & (half_cols < N // 2)[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _splitk_reduce_kernel(ws_ptr, global_scale_ptr, bias_ptr, out_ptr, num_rows, N, stride_gn, stride_om,
                          swiglu_limit, SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRET: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Two-launch fallback: out[m, cols] = bf16(sum over s = 0, 1, .., SPLITS-1 (in this order) of
    ws[s, m, cols] * global_scale * 2**8 + bias) -- the operations of the single-launch reduction. ``SWIGLU``:
    the same sum, then the SwiGLU of each (gate, up) column pair into out[m, cols // 2]
    (:func:`_swiglu_epilogue_store`). PDL: the prologue (megamoe/kernels/pdl.py)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    rows = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    ptrs = ws_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ptrs + (s * num_rows).to(tl.int64) * N, mask=col_mask[None, :], other=0.0)
    if SWIGLU:
        _swiglu_epilogue_store(acc, rows, rows < num_rows, tl.program_id(1) * BLOCK, N, global_scale_ptr, stride_gn,
                               bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK, HAS_BIAS, HAS_LIMIT, INTERPRET)
    else:
        _epilogue_store(acc, rows, rows < num_rows, cols, col_mask, N, global_scale_ptr, stride_gn, bias_ptr,
                        out_ptr, stride_om, HAS_BIAS, INTERPRET)


if GLUON_AVAILABLE:

    @gluon.constexpr_function
    def _reduce_layout(num_warps):
        """(rows, columns) tiles of the workspace: token rows over the warps, columns over the lanes."""
        return gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])

    @gluon.jit
    def _gluon_store_partial(acc, row_start, row_end, num_rows, n_start, N, pid_k, ws_ptr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """acc (BLOCK_N weight rows, BLOCK_M tokens) fp32 -> workspace[pid_k, row_start.., n_start..]."""
        red_layout: gl.constexpr = _reduce_layout(num_warps)
        part = gl.convert_layout(acc.permute([1, 0]), red_layout)  # (BLOCK_M, BLOCK_N)
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, red_layout))
        cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, red_layout))
        base = ws_ptr + (pid_k * num_rows).to(gl.int64) * N
        gl.store(base + rows.to(gl.int64)[:, None] * N + cols[None, :], part,
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _gluon_last_program_reduces(ws_ptr, cnt_ptr, slot, splits, row_start, row_end, num_rows, n_start, N,
                                    global_scale_ptr, stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M: gl.constexpr,
                                    BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
        """The single-launch reduction of the Gluon kinds (as ``_last_program_reduces``): ticket on
        counter ``slot``; the last program sums workspace[0..splits-1] of rows [row_start, row_end) x its
        BLOCK_N columns in index order, writes bf16 and resets the counter."""
        gl.thread_barrier()  # every thread's partial stores precede the (release) ticket
        ticket = gl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            red_layout: gl.constexpr = _reduce_layout(num_warps)
            cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, red_layout))
            col_mask = cols < N
            gscale = gl.load(global_scale_ptr + gl.minimum(cols, N - 1).to(gl.int64) * stride_gn) * 256.0
            r0 = row_start + slot * 0
            while r0 < row_end:
                rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, red_layout))
                mask = (rows < row_end)[:, None] & col_mask[None, :]
                ptrs = ws_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
                acc = gl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, splits):
                    acc += gl.load(ptrs + (s * num_rows).to(gl.int64) * N, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                acc = acc * gscale[None, :]
                if HAS_BIAS:
                    acc = acc + gl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(gl.float32)[None, :]
                gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], acc.to(gl.bfloat16),
                         mask=mask)
                r0 += BLOCK_M
            gl.store(cnt_ptr + slot, 0)  # every program of this tile has drawn its ticket

    @gluon.jit
    def _mma_rows_pass(words, scale_bytes, r0, num_rows, x_ptr, x_cols, stride_xm, w_ptrs, s_ptrs, k_steps, last,
                       n_start, N, pid_k, global_scale_ptr, stride_gn, bias_ptr, out_ptr, stride_om, swiglu_limit,
                       ws_ptr, mma_layout: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr,
                       x_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       DIRECT: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
        """One pass of the mma.sync kind over token rows [r0, r0 + BLOCK_M), given its first weight step (words,
        scale bytes): the K loop (register double-buffering as in nvfp4_mma_decode; the load past the end re-reads
        the last step), then bf16 out (DIRECT) or workspace[pid_k]."""
        rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        x_mask = (rows < num_rows)[:, None]
        x_ptrs = x_ptr + rows.to(gl.int64)[:, None] * stride_xm + x_cols[None, :]
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
        x_pairs = gl.load(x_ptrs, mask=x_mask, other=0)
        for step in range(0, k_steps):
            nxt = gl.minimum((step + 1) * BLOCK_K, last)
            words_n, scale_n = load_weights(w_ptrs, s_ptrs, nxt)
            x_next = gl.load(x_ptrs + nxt // 2, mask=x_mask, other=0)
            acc = _gluon_mma_step(acc, words, scale_bytes, x_pairs, a_layout, b_layout, BLOCK_N, BLOCK_M, BLOCK_K)
            words, scale_bytes, x_pairs = words_n, scale_n, x_next
        if DIRECT:
            store_epilogue(acc, r0, num_rows, k_steps > 0, n_start, N, global_scale_ptr, 0, 0, stride_gn,
                           bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, False, False,
                           num_warps)
        else:
            _gluon_store_partial(acc, r0, num_rows, num_rows, n_start, N, pid_k, ws_ptr, BLOCK_M, BLOCK_N, num_warps)

    @gluon.jit(do_not_specialize=["num_rows", "splits"])
    def _splitk_mma_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
        num_rows, N, K, chunk_steps, splits, swiglu_limit,
        stride_xm, stride_wn, stride_sn, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, DIRECT: gl.constexpr,
        FUSED: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
        EARLY_READS: gl.constexpr = False,
    ):
        """Gluon mma.sync partial sums (dense): program (pid_n, pid_k) decodes its K slice into
        A-operand registers (nvfp4_mma_decode's step) for BLOCK_M token rows per pass; with FUSED the
        last program of column tile pid_n reduces (counter ``cnt_ptr[pid_n]``).
        ``row_index_ptr`` / ``offsets_ptr`` / ``swiglu_limit`` are unused (the shared compile helper's
        argument set). K is a multiple of BLOCK_K; each split takes ``chunk_steps`` steps.
        PDL: the prologue (megamoe/kernels/pdl.py). EARLY_READS (launcher: num_rows <= BLOCK_M, one row pass; the
        caller vouched that the weights were final before the previous kernel started): the first weight step is
        loaded before the PDL wait, x and everything else after it."""
        if not EARLY_READS:
            gl_grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_layout: gl.constexpr = x_operand_layout(BLOCK_M, BLOCK_K, num_warps)

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        k_begin = pid_k * chunk_steps * BLOCK_K  # a multiple of the constexpr BLOCK_K: aligned loads
        k_steps = gl.minimum(K // BLOCK_K - pid_k * chunk_steps, chunk_steps)
        n_start = pid_n * BLOCK_N
        w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
        w_cols = k_begin // 8 + gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        w_ptrs = w_ptr + w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
        s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
        s_cols = k_begin // 16 + gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        s_ptrs = scale_ptr + s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
        x_cols = k_begin // 2 + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, x_layout))
        last = gl.maximum(k_steps - 1, 0) * BLOCK_K

        if EARLY_READS:
            words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0)
            gl_grid_dependency_prologue(PDL)  # x, the workspace, the counters and out only after the wait
            _mma_rows_pass(words, scale_bytes, pid_n * 0, num_rows, x_ptr, x_cols, stride_xm, w_ptrs, s_ptrs, k_steps,
                           last, n_start, N, pid_k, global_scale_ptr, stride_gn, bias_ptr, out_ptr, stride_om,
                           swiglu_limit, ws_ptr, mma_layout, a_layout, b_layout, x_layout, BLOCK_M, BLOCK_N, BLOCK_K,
                           DIRECT, HAS_BIAS, num_warps)
        else:
            r0 = pid_n * 0
            while r0 < num_rows:
                words, scale_bytes = load_weights(w_ptrs, s_ptrs, 0)
                _mma_rows_pass(words, scale_bytes, r0, num_rows, x_ptr, x_cols, stride_xm, w_ptrs, s_ptrs, k_steps,
                               last, n_start, N, pid_k, global_scale_ptr, stride_gn, bias_ptr, out_ptr, stride_om,
                               swiglu_limit, ws_ptr, mma_layout, a_layout, b_layout, x_layout, BLOCK_M, BLOCK_N,
                               BLOCK_K, DIRECT, HAS_BIAS, num_warps)
                r0 += BLOCK_M
        if FUSED:
            _gluon_last_program_reduces(ws_ptr, cnt_ptr, pid_n, splits, pid_n * 0, num_rows, num_rows, n_start, N,
                                        global_scale_ptr, stride_gn, bias_ptr, out_ptr, stride_om, BLOCK_M, BLOCK_N,
                                        HAS_BIAS, num_warps)

    @gluon.jit(do_not_specialize=["num_rows", "splits"])
    def _splitk_wgmma_kernel(
        x_ptr, row_index_ptr, w_ptr, scale_ptr, global_scale_ptr, offsets_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
        num_rows, N, K, chunk_steps, splits, swiglu_limit,
        stride_xm, stride_wn, stride_sn, stride_gn, stride_om,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, DIRECT: gl.constexpr,
        FUSED: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Gluon wgmma partial sums (dense, swap-AB, the step of ``nvfp4_wgmma.py``): program
        (pid_m, pid_n, pid_k) computes token rows [pid_m*BLOCK_M, +BLOCK_M) x weight rows
        [pid_n*BLOCK_N, +BLOCK_N) over the K slice of split pid_k, the weight tile decoded into the
        wgmma A registers and the x^T tile staged in shared memory. With FUSED the last program of the
        (pid_m, pid_n) tile reduces (counter ``cnt_ptr[pid_m * cdiv(N, BLOCK_N) + pid_n]``). Unused
        arguments as in ``_splitk_mma_kernel``. BLOCK_N = 16 * num_warps, BLOCK_M >= 8 * num_warps. PDL: the
        prologue (megamoe/kernels/pdl.py)."""
        gl_grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = weight_layout(BLOCK_N, BLOCK_K, num_warps)
        s_layout: gl.constexpr = scale_layout(BLOCK_N, BLOCK_K, num_warps)
        x_layout: gl.constexpr = x_split_layout(BLOCK_M, BLOCK_K, num_warps)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

        pid_m = gl.program_id(0)  # fastest: the row tiles of one weight slice run side by side (L2 reuse)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        k_begin = pid_k * chunk_steps * BLOCK_K  # a multiple of the constexpr BLOCK_K: aligned loads
        k_steps = gl.minimum(K // BLOCK_K - pid_k * chunk_steps, chunk_steps)
        n_start = pid_n * BLOCK_N
        row_start = pid_m * BLOCK_M
        row_end = gl.minimum(row_start + BLOCK_M, num_rows)
        w_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout)), N - 1)
        w_cols = k_begin // 8 + gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, w_layout))
        w_ptrs = w_ptr + w_rows.to(gl.int64)[:, None] * stride_wn + w_cols[None, :]
        s_rows = gl.minimum(n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), N - 1)
        s_cols = k_begin // 16 + gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, s_layout))
        s_ptrs = scale_ptr + s_rows.to(gl.int64)[:, None] * stride_sn + s_cols[None, :]
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
        x_cols = k_begin // 2 + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, x_layout))
        x_ptrs = x_ptr + rows.to(gl.int64)[:, None] * stride_xm + x_cols[None, :]
        x_mask = (rows < num_rows)[:, None]
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
        acc = wgmma_k_loop(acc, w_ptrs, s_ptrs, x_ptrs, x_mask, x_smem, k_steps, a_layout, BLOCK_N, BLOCK_M, BLOCK_K)
        if DIRECT:
            store_epilogue(acc, row_start, row_end, k_steps > 0, n_start, N, global_scale_ptr, 0, 0, stride_gn,
                           bias_ptr, out_ptr, stride_om, swiglu_limit, BLOCK_M, BLOCK_N, HAS_BIAS, False, False,
                           num_warps)
        else:
            _gluon_store_partial(acc, row_start, row_end, num_rows, n_start, N, pid_k, ws_ptr, BLOCK_M, BLOCK_N,
                                 num_warps)
            if FUSED:
                _gluon_last_program_reduces(ws_ptr, cnt_ptr, pid_m * gl.num_programs(1) + pid_n, splits, row_start,
                                            row_end, num_rows, n_start, N, global_scale_ptr, stride_gn, bias_ptr,
                                            out_ptr, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS, num_warps)


def compile_for_sm90(config=SPLITK_CONFIGS[8], *, direct=False, bias=False, fused=True, pdl=False, early_reads=False):
    """Compile a Gluon split-K kernel for sm_90 without a GPU (tests, offline SASS); ``config`` as
    :data:`SPLITK_CONFIGS` ("mma" or "wgmma" rows); ``pdl`` / ``early_reads``: the ``PDL`` / ``EARLY_READS``
    constexprs ("mma" only for the latter) and the launch option."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .nvfp4_gluon_jit import ALIGNED_ARGS, POINTER_ARGS

    kind, block_m, block_n, block_k, num_warps = config[:5]
    scalars = ["num_rows", "N", "K", "chunk_steps", "splits", "stride_xm", "stride_wn", "stride_sn", "stride_gn",
               "stride_om"]
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DIRECT=direct, FUSED=fused and not direct,
                     HAS_BIAS=bias, num_warps=num_warps, PDL=pdl)
    if kind != "wgmma":
        constants["EARLY_READS"] = early_reads
    kernel = _splitk_wgmma_kernel if kind == "wgmma" else _splitk_mma_kernel
    pointers = {name: kind for name, kind in POINTER_ARGS.items() if name in kernel.arg_names}  # no err_ptr here
    signature = dict(pointers, ws_ptr="*fp32", cnt_ptr="*i32", **{name: "i32" for name in scalars},
                     swiglu_limit="fp32", **{name: "constexpr" for name in constants})
    signature = {name: signature[name] for name in kernel.arg_names}
    aligned = [a for a in ALIGNED_ARGS if a in kernel.arg_names] + ["ws_ptr"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                             "launch_pdl": pdl})


def compile_partial_for_sm90(config=SPLITK_CONFIGS[1], *, direct=False, bias=False, even_k=True, fused=True,
                             pdl=False, early_reads=False):
    """Compile the Triton partial kernel for sm_90 without a GPU ("fma" / "dot" configs); ``pdl`` /
    ``early_reads`` as :func:`compile_for_sm90`'s."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, block_m, block_n, block_k, num_warps, _, maxnreg = config
    dot = kind == "dot"
    signature = dict(x_ptr="*bf16" if dot else "*i32", w_ptr="*u8" if dot else "*i32", scale_ptr="*u8",
                     global_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32",
                     num_rows="i32", N="i32", K="i32", chunk_steps="i32", splits="i32", stride_xm="i32",
                     stride_wn="i32", stride_sn="i32", stride_gn="i32", stride_om="i32")
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=dot, DIRECT=direct,
                     FUSED=fused and not direct, HAS_BIAS=bias, EVEN_K=even_k, INTERPRET=False, PDL=pdl,
                     EARLY_READS=early_reads)
    signature.update({name: "constexpr" for name in constants})
    kernel = _splitk_partial_kernel
    aligned = ["x_ptr", "w_ptr", "scale_ptr", "global_scale_ptr", "bias_ptr", "out_ptr", "ws_ptr", "N", "K",
               "stride_xm", "stride_wn", "stride_sn", "stride_om"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "launch_pdl": pdl}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


# Routing (megamoe/ops/gemm.py: decode_route, dense only, host shapes only). Per shape class, the largest
# M routed to split-K (the first class whose weight-element bound N*K is >= the shape's wins):
#   "small" (N*K <= 2**24: 4096x4096, 1024x4096): launch- and latency-bound, the single-launch reduction;
#   "large" (32768x1024, 4096x8192) and "huge" (N*K > 2**26: 18432x7168): bandwidth-bound; the same bounds,
#   "huge" only takes other tile configs (SPLITK_CLASS_CONFIGS).
# M <= 16 measured (gemm_dense_splitk_20261123_1435: 1.1-1.9x bf16 at M = 1, 8); 17..64 are the wgmma
# kind, predicted >= bf16 (NOTES_gemm.md, v13), to be confirmed by `bench_gemm.py --dense-splitk`, which
# also times M = 128, 256 ("measure-ready": raise a bound here when the table shows split-K ahead).
DENSE_SPLITK_MAX_ROWS = (
    ("small", 1 << 24, 64),
    ("large", 1 << 26, 64),
    ("huge", 1 << 62, 64),
)
# Above the class bound, up to DENSE_SPLITK_LONG_K_ROWS rows where K >= DENSE_SPLITK_LONG_K: measured at M = 128
# and 256 (gemm_dense_v16, H100, graph replay) split-K's wgmma kind beat the route taken before on every shape with
# K >= 4096 (4096x4096 21.1 / 32.9 us vs 59.6 / 57.4; 1024x4096 19.0 / 31.5 vs 59.1 / 57.4; 18432x7168 186.9 /
# 277.2 vs 201.2 / 307.8; 4096x8192 32.1 / 54.3 vs 112.5 / 111.7) and lost on 32768x1024 (38.0 / 73.6 vs 27.8 /
# 54.9: one split, a short K loop per tile).
DENSE_SPLITK_LONG_K = 4096
DENSE_SPLITK_LONG_K_ROWS = 256
# Above the class bound, up to DENSE_SPLITK_MID_K_ROWS rows where
# DENSE_SPLITK_MID_K <= K < DENSE_SPLITK_LONG_K: measured
# (results/gpu_check_v34/c_dense_splitk.md, H100, graph replay, the shared experts' down shapes) split-K against the
# route taken before ("tensor-core") at M = 96 / 128 / 192 / 256: 4096x2048 15.4 / 19.0 / 31.2 / 34.0 vs 32.1 / 31.3 /
# 30.4 / 30.1 us; 7168x3072 23.6 / 25.7 / 42.7 / 47.2 vs 45.1 / 44.5 / 44.8 / 44.6 us: ahead up to 128 rows, even or
# behind above.
DENSE_SPLITK_MID_K = 2048
DENSE_SPLITK_MID_K_ROWS = 128
SPLITK_MAX_ROWS = 256  # overall cap (benchmarks set it to 0 to time the route the op took before split-K)


def dense_shape_class(n: int, k: int) -> tuple[str, int]:
    """(class name, largest M routed to split-K) of a dense (N, K) weight, from :data:`DENSE_SPLITK_MAX_ROWS`."""
    for name, max_elements, max_rows in DENSE_SPLITK_MAX_ROWS:
        if n * k <= max_elements:
            return name, max_rows
    return DENSE_SPLITK_MAX_ROWS[-1][0], DENSE_SPLITK_MAX_ROWS[-1][2]


def splitk_max_rows(n: int, k: int) -> int:
    """The largest M the dense route sends to split-K for an (N, K) weight: the shape class's bound, raised to
    :data:`DENSE_SPLITK_LONG_K_ROWS` for K >= :data:`DENSE_SPLITK_LONG_K` (to :data:`DENSE_SPLITK_MID_K_ROWS` for K >=
    :data:`DENSE_SPLITK_MID_K`), capped by :data:`SPLITK_MAX_ROWS`."""
    rows = dense_shape_class(n, k)[1]
    if k >= DENSE_SPLITK_LONG_K:
        rows = max(rows, DENSE_SPLITK_LONG_K_ROWS)
    elif k >= DENSE_SPLITK_MID_K:
        rows = max(rows, DENSE_SPLITK_MID_K_ROWS)
    return min(SPLITK_MAX_ROWS, rows)


def splitk_preferred(num_rows: int, n: int, k: int) -> bool:
    """Host-shape rule for dense GEMMs: decode-sized M for the shape (any N, K % 16 == 0)."""
    return 0 < num_rows <= splitk_max_rows(n, k) and k % 16 == 0


def splitk_supports(x: torch.Tensor, data: torch.Tensor) -> bool:
    """Alignment the int32 views need (x rows and packed weight rows on 4-byte boundaries); K % 16."""
    return (x.stride(-1) == 1 and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
            and data.dim() == 2 and data.is_contiguous() and data.data_ptr() % 4 == 0 and data.shape[-1] % 8 == 0)


def splitk_early_reads(weight_settled: bool, kind: str, num_rows: int, block_m: int, even_k: bool) -> bool:
    """Whether a split-K launch (built with the PDL prologue) loads its first weight step before its PDL wait: the
    caller vouched for the weights (``weight_settled``), "splitk" is in :data:`megamoe.kernels.pdl.PDL_EARLY_READS`,
    and each program makes one row pass of the mma.sync or CUDA-core kind (``num_rows <= block_m``; the CUDA-core
    kind also needs K % BLOCK_K == 0). Host values only."""
    return (weight_settled and pdl_early_reads("splitk") and kind in ("mma", "fma") and num_rows <= block_m
            and (even_k or kind == "mma"))


def launch_nvfp4_splitk(
    x: torch.Tensor,
    data: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    interpreter: bool = False,
    config=None,
    splits: int | None = None,
    fused: bool | None = None,
    expert_offsets=None,
    row_index=None,
    swiglu: bool = False,
    swiglu_limit=None,
    weight_settled: bool = False,
) -> torch.Tensor:
    """Launch the dense split-K NVFP4 GEMM (inputs validated by ``megamoe.ops.gemm``).

    x (M, K) bf16, last dim contiguous, rows 4-byte aligned; data (N, K//2) uint8 contiguous (low
    nibble = even element); block_scale (N, K//16) float8_e4m3fn; global_scale 0-d or (N, 1) fp32;
    bias None or (N,) float; out (M, N) bf16 (row-major). K a multiple of 16 (:func:`splitk_supports`).
    ``config``: a :data:`SPLITK_CONFIGS` value (else :func:`select_splitk_config`); ``splits``:
    override the planned split count (benchmarks); ``fused``: None chooses the single-launch reduction for
    M <= :data:`FUSED_MAX_ROWS`, True forces it, False the two-launch reduction (the same bits either way).
    Dense only: grouped arguments are refused.
    ``swiglu``: the weight rows are in the interleaved gate/up layout (N even) and out is (M, N // 2) bf16 = the
    SwiGLU of the float32 sums (clamped at ``swiglu_limit`` unless None), computed by the two-launch reduction
    (always taken then, also with one split), so the float32 gate/up values are never rounded before the SwiGLU.
    ``weight_settled``: the caller's promise that data / block_scale were final before the kernel that precedes this
    launch on the stream started (a model's parameters); with PDL (:func:`megamoe.kernels.pdl.pdl_flags` for
    "splitk", and ``pdl_early_reads("splitk")``) a one-pass launch of the mma.sync or CUDA-core kind then loads its
    first weight step before its PDL wait (:func:`splitk_early_reads`). The same bits either way.
    Returns ``out``; bit-identical across runs for the same inputs and config.
    """
    if expert_offsets is not None or row_index is not None:
        raise ValueError("expert_offsets: the split-K kernel is dense only")
    m = out.shape[0]
    n, k = data.shape[0], 2 * data.shape[1]
    if swiglu and n % 2:
        raise ValueError(f"data: SwiGLU needs an even N (interleaved gate/up rows), got {n}")
    if m == 0 or n == 0:
        return out
    gluon_ok = not interpreter and gluon_supports(x, data)
    config = tuple(config or select_splitk_config(m, interpreter, gluon_ok, n, k))
    kind, block_m, block_n, block_k, num_warps, per_sm, maxnreg = config
    if kind in ("mma", "wgmma"):
        if interpreter or not gluon_ok:
            raise ValueError(f"config: the Gluon {kind!r} kind needs an sm_90 GPU and K % 128 == 0")
        if k % block_k:
            block_k = 128
        if kind == "wgmma" and (block_n != 16 * num_warps or block_m < 8 * num_warps):
            raise ValueError(f"config: wgmma needs BLOCK_N = 16 * num_warps and BLOCK_M >= 8 * num_warps, got {config}")
    target = INTERPRETER_PROGRAMS if interpreter else _num_sms(x.device.index or 0) * per_sm
    m_tiles = triton.cdiv(m, block_m) if kind == "wgmma" else 1
    n_tiles = triton.cdiv(n, block_n)
    if splits is None:
        splits, k_chunk = plan_splitk(m, n, k, block_n, block_k, max(1, target // m_tiles))
    else:
        k_steps = triton.cdiv(k, block_k)
        per = triton.cdiv(k_steps, max(1, min(splits, k_steps)))
        splits, k_chunk = triton.cdiv(k_steps, per), per * block_k
    direct = splits == 1 and not swiglu
    ws = out if direct else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    counters = None
    if swiglu:
        fused = False  # the SwiGLU runs in the two-launch reduction
    elif fused is None:
        fused = default_single_launch(m)
    if not direct and fused and m_tiles * n_tiles <= COUNTER_SLOTS:
        counters = splitk_counters(x.device)
    fused_launch = counters is not None
    cnt = counters if fused_launch else ws
    _, stride_gn = global_scale_strides(global_scale, False)
    scale_u8 = block_scale.view(torch.uint8)
    bias_arg = bias if bias is not None else out
    # launched with PDL (per-kernel settings) only as one launch whose grid fits in one wave of its config's programs
    # per SM: then no program of it is still to come when its waiting dependents take free SM slots (kernels/pdl.py).
    # The plan can exceed a wave (split counts are rounded: 18432x7168 at M = 1 is 432 programs on 396 slots), and a
    # second (reduction) launch would wait behind the first's dependents: measured slower with PDL (H200,
    # results/gpu_check_v40/bench_dense_pdl_a.md: 18432x7168 M = 1-8 and M = 64 on the wgmma kind 1.05-1.4x slower)
    one_wave = m_tiles * n_tiles * splits <= target
    pdl, launch_pdl = pdl_flags(x, "splitk", single_pass=one_wave and (direct or fused_launch))
    early = pdl and splitk_early_reads(weight_settled, kind, m, block_m, k % block_k == 0)
    if kind in ("mma", "wgmma"):
        x32, data32 = x.view(torch.int32), data.view(torch.int32)
        kernel = _splitk_wgmma_kernel if kind == "wgmma" else _splitk_mma_kernel
        grid = (m_tiles, n_tiles, splits) if kind == "wgmma" else (n_tiles, splits)
        kernel[grid](
            x32, x32, data32, scale_u8, global_scale, x32, bias_arg, out, ws, cnt,
            m, n, k, k_chunk // block_k, splits, 0.0, x32.stride(0), data32.stride(0), scale_u8.stride(0),
            stride_gn, out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DIRECT=direct, FUSED=fused_launch,
            HAS_BIAS=bias is not None, num_warps=num_warps, PDL=pdl, launch_pdl=launch_pdl,
            **({} if kind == "wgmma" else {"EARLY_READS": early}),
        )
    else:
        dot = kind == "dot"
        xa, wa = (x, data) if dot else (x.view(torch.int32), data.view(torch.int32))
        extra = {"maxnreg": maxnreg} if maxnreg is not None and not interpreter else {}
        _splitk_partial_kernel[(n_tiles, splits)](
            xa, wa, scale_u8, global_scale, bias_arg, out, ws, cnt,
            m, n, k, k_chunk // block_k, splits, xa.stride(0), wa.stride(0), scale_u8.stride(0), stride_gn,
            out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=dot, DIRECT=direct, FUSED=fused_launch,
            HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, INTERPRET=interpreter,
            num_warps=num_warps, num_stages=3 if dot else 1, PDL=pdl, launch_pdl=launch_pdl, EARLY_READS=early,
            **extra,
        )
    if not direct and not fused_launch:
        block = max(2, min(1024, triton.next_power_of_2(n)))  # even: a SwiGLU pair never straddles two programs
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](  # rows on the first axis (65535: the others' limit)
            ws, global_scale, bias_arg, out, m, n, stride_gn, out.stride(0),
            float(swiglu_limit) if swiglu_limit is not None else 0.0,
            SPLITS=splits, BLOCK=block, HAS_BIAS=bias is not None, SWIGLU=swiglu,
            HAS_LIMIT=swiglu and swiglu_limit is not None, INTERPRET=interpreter, num_warps=4, PDL=pdl,
            launch_pdl=launch_pdl,
        )
    return out
