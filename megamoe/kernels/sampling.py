"""Token sampler: temperature + counter-based Gumbel noise + argmax over a row's candidates, in two launches.

Two kernels, one launcher (:func:`launch_sample`). Semantics: ``megamoe/reference/sampling.py`` (step 5 of its
definition and the counter update of step 6). The row is streamed in ``BLOCK_V`` chunks:

* unsorted candidates (no top-k / top-p in the batch): ``values`` are the raw logits (any float dtype), the
  column is the token id, the kernel divides by the row's temperature (greedy rows: no division, no noise);
* sorted candidates (top-k / top-p): ``values`` are the descending, already temperature-scaled logits, ``ids``
  the token of each rank and ``n_keep`` the kept prefix length; columns past the prefix are masked (no reads).

A row is split over P programs (grid (B, P), each a contiguous range of chunks, P from shapes only) that write
their best key and its column; a second one-warp launch per row merges the P results in part order. At batch 1
the 129280-token vocabulary is read by 64 programs instead of one (measured on the H100 before the split: 90 us
per greedy step for one row).

Noise: the reference's 32-bit mixer on (seed, step, token id) -> uniform -> ``-log(-log(u))``, identical integer
bits; the logarithms may differ from torch's in the last ulp (the sampled token then differs only when two
keys are within an ulp). Running argmax with the lowest index on ties; NaN logits count as ``-inf``. Each row's
``step`` counter is incremented by the merging program after every part has read it. Device values never reach the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.sampling import MIX_MUL_1, MIX_MUL_2, SEED_OFFSET, TOKEN_OFFSET
from .pdl import grid_dependency_prologue, pdl_enabled

# 2048-wide chunks with 8 warps: 8 fp32 per thread per chunk, 64 chunks for V = 129280; rows split over parts
# so that the grid holds about SAMPLE_TARGET_PROGRAMS programs (a fixed constant: the split is a shape decision).
SAMPLE_CONFIG = {"BLOCK_V": 2048, "num_warps": 8}
SAMPLE_TARGET_PROGRAMS = 264
INTERPRETER_CONFIG = {"BLOCK_V": 64, "num_warps": 1}
_MUL_1 = tl.constexpr(MIX_MUL_1)
_MUL_2 = tl.constexpr(MIX_MUL_2)
_SEED_OFFSET = tl.constexpr(SEED_OFFSET)
_TOKEN_OFFSET = tl.constexpr(TOKEN_OFFSET)


@triton.jit
def _mix32(x):
    """The reference's 32-bit mixer on uint32 (multiplication wraps modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, _MUL_1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, _MUL_2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_partial_kernel(
    values_ptr,  # (B, >=N) logits (unsorted) or fp32 scaled sorted values, row stride stride_v
    ids_ptr,  # (B, >=N) int64 token of each rank (read if SORTED), row stride stride_i
    n_keep_ptr,  # (B,) int32 kept prefix length (read if SORTED)
    temperature_ptr,  # (B,) fp32
    seed_ptr,  # (B,) int64
    step_ptr,  # (B,) int64 (read only here)
    part_best_ptr,  # (B, P) fp32: the part's best key
    part_at_ptr,  # (B, P) int32: its column (the part's first column when the part holds no finite key)
    N,
    stride_v,
    stride_i,
    P,
    SORTED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNKS_PER_PART: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row, part): the best key over columns
    [part * CHUNKS_PER_PART * BLOCK_V, + CHUNKS_PER_PART * BLOCK_V)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    temp = tl.load(temperature_ptr + row)
    greedy = temp <= 0.0
    divisor = tl.where(greedy, 1.0, temp)
    if SORTED:
        divisor = 1.0  # values are scaled already
        n = tl.minimum(tl.load(n_keep_ptr + row), N)
    else:
        n = N
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ tl.full((), _SEED_OFFSET, tl.uint32))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32))
    cols = tl.arange(0, BLOCK_V)
    first = part * (CHUNKS_PER_PART * BLOCK_V)
    best = tl.full((), float("-inf"), tl.float32)
    best_at = first
    for c in range(CHUNKS_PER_PART):
        idx = first + c * BLOCK_V + cols
        mask = idx < n
        v = tl.load(values_ptr + row * stride_v + idx, mask=mask, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("-inf"), v)
        if SORTED:
            tok = tl.load(ids_ptr + row * stride_i + idx, mask=mask, other=0)
        else:
            tok = idx
        bits = _mix32(_mix32(tok.to(tl.uint32) + key) ^ tl.full(idx.shape, _TOKEN_OFFSET, tl.uint32))
        u = ((bits >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        noise = -tl.log(-tl.log(u))
        k = v / divisor + tl.where(greedy, 0.0, noise)
        k = tl.where(mask, k, float("-inf"))
        chunk_best = tl.max(k, axis=0)
        chunk_at = tl.min(tl.where(k == chunk_best, idx, 2147483647), axis=0)
        better = chunk_best > best
        best_at = tl.where(better, chunk_at, best_at)
        best = tl.where(better, chunk_best, best)
    tl.store(part_best_ptr + row * P + part, best)
    tl.store(part_at_ptr + row * P + part, best_at)


@triton.jit
def _sample_merge_kernel(
    part_best_ptr, part_at_ptr,  # (B, P) from the partial kernel
    ids_ptr, stride_i,  # sorted candidates' token ids (SORTED)
    step_ptr,  # (B,) int64, incremented
    out_ptr,  # (B,) int64
    P,
    SORTED: tl.constexpr,
    P_P2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row r: the parts' best in part order (the lowest column on ties, as one pass over the row would pick)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, P_P2)
    valid = j < P
    b = tl.load(part_best_ptr + row * P + j, mask=valid, other=float("-inf"))
    at = tl.load(part_at_ptr + row * P + j, mask=valid, other=2147483647)
    top = tl.max(b, axis=0)
    best_at = tl.min(tl.where(valid & (b == top), at, 2147483647), axis=0)
    if SORTED:
        token = tl.load(ids_ptr + row * stride_i + best_at)
    else:
        token = best_at.to(tl.int64)
    tl.store(out_ptr + row, token.to(tl.int64))
    step = tl.load(step_ptr + row)
    tl.store(step_ptr + row, step + 1)


def sample_parts(num_rows: int, n: int, block_v: int) -> tuple[int, int]:
    """(parts per row, chunks per part) from shapes only: about two programs per SM of an H100 over the batch
    (a row of V = 129280 at batch 1 spreads over 64 programs instead of one program walking 64 chunks)."""
    chunks = max(triton.cdiv(n, block_v), 1)
    want = max(1, min(chunks, SAMPLE_TARGET_PROGRAMS // max(num_rows, 1)))
    per = triton.cdiv(chunks, want)
    return triton.cdiv(chunks, per), per


def launch_sample(values: torch.Tensor, ids: torch.Tensor | None, n_keep: torch.Tensor | None,
                  temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, out: torch.Tensor, *,
                  interpreter: bool = False) -> torch.Tensor:
    """values (B, N) float, unit column stride; ids (B, N) int64 + n_keep (B,) int32 for sorted candidates (both
    or neither); temperature (B,) fp32, seed / step (B,) int64 contiguous; out (B,) int64. Increments step.

    Two launches: grid (B, P) partial maxima into a (B, P) workspace allocated per call (graph-safe: the graph's
    pool), then grid (B,) merging them in part order. The token does not depend on P (an argmax, no sums)."""
    num_rows, n = values.shape
    if num_rows == 0:
        return out
    cfg = INTERPRETER_CONFIG if interpreter else SAMPLE_CONFIG
    sorted_ = ids is not None
    parts, per = sample_parts(num_rows, n, cfg["BLOCK_V"])
    if interpreter:  # a few parts, so that the CPU tests still cross part boundaries
        chunks = max(triton.cdiv(n, cfg["BLOCK_V"]), 1)
        per = triton.cdiv(chunks, min(parts, 4))
        parts = triton.cdiv(chunks, per)
    part_best = torch.empty((num_rows, parts), dtype=torch.float32, device=values.device)
    part_at = torch.empty((num_rows, parts), dtype=torch.int32, device=values.device)
    pdl = pdl_enabled(values)
    _sample_partial_kernel[(num_rows, parts)](
        values, ids if sorted_ else seed, n_keep if sorted_ else seed, temperature, seed, step, part_best, part_at,
        n, values.stride(0), ids.stride(0) if sorted_ else 0, parts, SORTED=sorted_, BLOCK_V=cfg["BLOCK_V"],
        CHUNKS_PER_PART=per, num_warps=cfg["num_warps"], PDL=pdl, launch_pdl=pdl,
    )
    _sample_merge_kernel[(num_rows,)](
        part_best, part_at, ids if sorted_ else seed, ids.stride(0) if sorted_ else 0, step, out, parts,
        SORTED=sorted_, P_P2=max(triton.next_power_of_2(parts), 2), num_warps=1, PDL=pdl, launch_pdl=pdl,
    )
    return out
