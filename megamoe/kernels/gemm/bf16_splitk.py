"""``x @ W^T`` with bf16 x and bf16 W, float32 out, at decode sizes (M = 1..64): split-K, one launch.

One kernel, one launcher (:func:`launch_bf16_splitk`).

Why: DeepSeek-V4's compressor projections (``compressor.wkv | wgate``, and the indexer's on CSA layers) are bf16 in the
checkpoint and computed in float32 (official ``Compressor.forward``: ``x.float()`` through float32 linears). Kept as
float32 copies they cost twice the bytes, and cuBLAS's float32 GEMV / SGEMM at M = 1..8 streams them at ~1-2 TB/s
(decode-step profile, ``benchmarks/results/gpu_check_v30/a_profile.log``: 44 us for the CSA layer's 42 MB at M = 8).
Every product of two bf16 values is exact in float32 (8 x 8 significant bits), so the bf16 weights on the tensor
cores with float32 sums compute the same math as the float32 path, up to the summation order.

Grid ``(cdiv(N, BLOCK_N), splits)``: program ``(j, s)`` owns weight rows ``[j*BLOCK_N, +BLOCK_N)`` and the K range of
split s (``nvfp4_splitk.plan_splitk``: enough splits for one wave). Swap-AB: the weight tile is the dot's left
operand (BLOCK_N rows), x^T the right one (BLOCK_M = 16 token rows, the dot's minimum); more rows are further passes
over the program's (L2-resident) weight slice.

Numerics: the tensor cores sum one BLOCK_K chunk of exact products from zero (their internal adds may truncate: at
most 2u relative each); the chunk is added to the float32 accumulator by an FMA on the CUDA cores (``one`` is 1.0 at
run time, so the compiler cannot fold the add into the MMA), as ``router_logits.py`` does; the splits' partials are
summed in fixed order. Error at most ``(2 BLOCK_K + K / BLOCK_K + splits + 4) u * sum_k |x_k| |w_nk|`` (u = 2**-24):
:func:`error_bound_units`. The same bits on every run, eager or graph replay: the reduction below does not depend on
which program arrives last.

Single-launch reduction (splits > 1): each program stores its partial into a float32 workspace ``(splits, M, N)``,
then (after a CTA barrier) draws a ticket with one ``atomic_add(acq_rel, gpu scope)`` on its column tile's counter
(``nvfp4_splitk.splitk_counters``: the same per-device zeros, left zero by every launch); the program that draws
ticket ``splits - 1`` loads the tile's ``(splits, rows, BLOCK_N)`` partials at once and sums them over the splits
(``tl.sum``: a fixed tree), writes the float32 output and resets the counter. While a CUDA graph is being captured
before any eager split-K launch on the device there are no counters yet: the launch then takes one split (the
direct store; slower, same math).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4_splitk import _num_sms, plan_splitk, splitk_counters

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs_per_sm)
BF16_SPLITK_CONFIG = (16, 64, 128, 4, 3, 4)
# Interpreter (CPU tests): small tiles, so that N / K edges, splits and row passes are exercised at test sizes.
INTERPRETER_CONFIG = (16, 16, 32, 4, 1, 1)
INTERPRETER_PROGRAMS = 12  # the "SM count" the interpreter plans for
#: Largest (splits x reduction rows x BLOCK_N) tile the last program loads at once (registers: 64 per thread at 4
#: warps); the reduction walks the rows in passes of that many.
REDUCE_TILE_ELEMENTS = 8192


def error_bound_units(k: int, splits: int, block_k: int | None = None) -> int:
    """The error bound's factor: ``|y - exact| <= factor * 2**-24 * sum_k |x_k| |w_nk|`` (module docstring)."""
    block_k = block_k or BF16_SPLITK_CONFIG[2]
    return 2 * block_k + triton.cdiv(k, block_k) + splits + 4


@triton.jit
def _sum_partials_last(ws_ptr, cnt_ptr, slot, splits, num_rows, cols, col_mask, N, out_ptr, stride_om,
                       SPLITS_PAD: tl.constexpr, RED_ROWS: tl.constexpr):
    """After this program's partial is stored: ticket on counter ``slot``; the last of the ``splits`` programs sums
    workspace[0..splits-1] of its column tile (a fixed tree over the splits), stores float32, resets the counter."""
    tl.debug_barrier()  # every thread's partial stores precede the (release) ticket
    ticket = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_r = tl.arange(0, RED_ROWS)
        s_ok = offs_s < splits
        r0 = slot * 0
        while r0 < num_rows:
            rows = r0 + offs_r
            row_ok = rows < num_rows
            ptrs = (ws_ptr + (offs_s[:, None, None] * num_rows + rows[None, :, None]).to(tl.int64) * N
                    + cols[None, None, :])
            mask = s_ok[:, None, None] & row_ok[None, :, None] & col_mask[None, None, :]
            parts = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], total,
                     mask=row_ok[:, None] & col_mask[None, :])
            r0 += RED_ROWS
        tl.store(cnt_ptr + slot, 0)  # every program of this tile has drawn its ticket: ready for the next launch


@triton.jit
def _chunk_step(acc, w_ptrs, x_ptrs, k0, k_len, offs_k, row_mask, one, EVEN_K: tl.constexpr,
                INTERPRET: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M) += the BLOCK_K chunk at k0: one tensor-core dot from zero, added by an FMA."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0)
        xt = tl.load(x_ptrs + k0, mask=row_mask[None, :], other=0.0)
    else:
        k_ok = (k0 + offs_k) < k_len
        w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & row_mask[None, :], other=0.0)
    if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 values and their products are exact in fp32
        w = w.to(tl.float32)
        xt = xt.to(tl.float32)
    # promotion: the chunk's tensor-core sum is added on the CUDA cores (module docstring)
    return acc + tl.dot(w, xt) * one


@triton.jit(do_not_specialize=["num_rows"])
def _bf16_splitk_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, one, num_rows, N, K, chunk_steps, splits,
                        stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, RED_ROWS: tl.constexpr, DIRECT: tl.constexpr,
                        EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Weight rows [pid_n*BLOCK_N, +BLOCK_N) over split pid_k's K range, every token row (passes of BLOCK_M);
    DIRECT: one split, float32 out; else partials into ws (splits, num_rows, N) and the single-launch reduction."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_begin = pid_k * chunk_steps * BLOCK_K  # a multiple of BLOCK_K (aligned, vectorised loads)
    k_len = tl.minimum(K - k_begin, chunk_steps * BLOCK_K)  # > 0: the host plans non-empty splits
    k_steps = (k_len + BLOCK_K - 1) // BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)  # clamp instead of masking the weight loads
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_begin + offs_k)[None, :]  # (BLOCK_N, BLOCK_K)
    r0 = pid_n * 0  # a tensor: loop-carried below
    while r0 < num_rows:
        rows = r0 + offs_r
        row_mask = rows < num_rows
        x_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + (k_begin + offs_k)[:, None]  # x^T (BLOCK_K, M)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if INTERPRET:  # the interpreter cannot range() over a runtime bound
            kt = 0
            while kt < k_steps:
                acc = _chunk_step(acc, w_ptrs, x_ptrs, kt * BLOCK_K, k_len, offs_k, row_mask, one, EVEN_K, True)
                kt += 1
        else:
            for kt in range(0, k_steps):
                acc = _chunk_step(acc, w_ptrs, x_ptrs, kt * BLOCK_K, k_len, offs_k, row_mask, one, EVEN_K, False)
        out_tile = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
        mask = row_mask[:, None] & col_mask[None, :]
        if DIRECT:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out_tile, mask=mask)
        else:
            base = ws_ptr + (pid_k * num_rows).to(tl.int64) * N
            tl.store(base + rows.to(tl.int64)[:, None] * N + cols[None, :], out_tile, mask=mask)
        r0 += BLOCK_M
    if not DIRECT:
        _sum_partials_last(ws_ptr, cnt_ptr, pid_n, splits, num_rows, cols, col_mask, N, out_ptr, stride_om,
                           SPLITS_PAD, RED_ROWS)


def plan_bf16_splitk(m: int, n: int, k: int, device, config=None, interpreter: bool = False) -> tuple[int, int]:
    """(splits, k_chunk) for an (M, K) x (N, K)^T launch: host shapes only (one wave of programs)."""
    _, block_n, block_k, _, _, per_sm = config or (INTERPRETER_CONFIG if interpreter else BF16_SPLITK_CONFIG)
    sms = INTERPRETER_PROGRAMS if interpreter else _num_sms(torch.device(device).index or 0)
    return plan_splitk(m, n, k, block_n, block_k, per_sm * sms, weight_bytes=2 * n * k)


def launch_bf16_splitk(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                       interpreter: bool = False, config=None, splits: int | None = None) -> torch.Tensor:
    """x (M, K) bf16 and weight (N, K) bf16, both with unit column stride -> (M, N) float32 ``x @ weight^T``
    (``out``: optional (M, N) float32 with unit column stride). Inputs are checked by the caller
    (``megamoe.ops.gemm.bf16_linear_fp32``). ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages,
    programs_per_sm); ``splits``: force a split count (benchmarks, tests); ``interpreter``: CPU tensors through
    Triton's interpreter."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or (INTERPRETER_CONFIG if interpreter else BF16_SPLITK_CONFIG)
    block_m, block_n, block_k, num_warps, num_stages, _ = config
    k_steps = triton.cdiv(k, block_k)
    if splits is None:
        splits, k_chunk = plan_bf16_splitk(m, n, k, x.device, config, interpreter)
    else:
        splits = max(1, min(int(splits), k_steps))
        per = triton.cdiv(k_steps, splits)
        splits, k_chunk = triton.cdiv(k_steps, per), per * block_k
    n_tiles = triton.cdiv(n, block_n)
    counters = None
    if splits > 1:
        counters = splitk_counters(x.device)
        if counters is None or n_tiles > counters.numel():  # capturing before any eager launch: one split
            splits, k_chunk, counters = 1, k_steps * block_k, None
    if splits > 1:
        ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:
        ws, counters = out, out  # unused by the DIRECT kernel
    splits_pad = triton.next_power_of_2(splits)
    red_rows = max(1, min(block_m, REDUCE_TILE_ELEMENTS // (splits_pad * block_n)))
    red_rows = 1 << (red_rows.bit_length() - 1)  # a power of two
    _bf16_splitk_kernel[(n_tiles, splits)](
        x, weight, out, ws, counters, 1.0, m, n, k, k_chunk // block_k, splits,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS_PAD=splits_pad, RED_ROWS=red_rows,
        DIRECT=splits == 1, EVEN_K=k % block_k == 0, INTERPRET=interpreter,
        num_warps=num_warps, num_stages=num_stages)
    return out
