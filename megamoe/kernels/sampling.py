"""Token sampler: temperature + counter-based Gumbel noise + argmax over a row's candidates, in one launch.

One kernel, one launcher (:func:`launch_sample`). Semantics: ``megamoe/reference/sampling.py`` (step 5 of its
definition and the counter update of step 6). One program per row streams the row in ``BLOCK_V`` chunks:

* unsorted candidates (no top-k / top-p in the batch): ``values`` are the raw logits (any float dtype), the
  column is the token id, the kernel divides by the row's temperature (greedy rows: no division, no noise);
* sorted candidates (top-k / top-p): ``values`` are the descending, already temperature-scaled logits, ``ids``
  the token of each rank and ``n_keep`` the kept prefix length; the loop stops at the prefix (a top-k of 50
  reads one chunk).

Noise: the reference's 32-bit mixer on (seed, step, token id) -> uniform -> ``-log(-log(u))``, identical integer
bits; the logarithms may differ from torch's in the last ulp (the sampled token then differs only when two
keys are within an ulp). Running argmax with the lowest index on ties; NaN logits count as ``-inf``. Each row's
``step`` counter is incremented by the same program after it is read. Device values never reach the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.sampling import MIX_MUL_1, MIX_MUL_2, SEED_OFFSET, TOKEN_OFFSET

# One program per row; 2048-wide chunks with 8 warps: 8 fp32 per thread per chunk, 64 chunks for V = 129280.
SAMPLE_CONFIG = {"BLOCK_V": 2048, "num_warps": 8}
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
def _sample_kernel(
    values_ptr,  # (B, >=N) logits (unsorted) or fp32 scaled sorted values, row stride stride_v
    ids_ptr,  # (B, >=N) int64 token of each rank (read if SORTED), row stride stride_i
    n_keep_ptr,  # (B,) int32 kept prefix length (read if SORTED)
    temperature_ptr,  # (B,) fp32
    seed_ptr,  # (B,) int64
    step_ptr,  # (B,) int64, incremented
    out_ptr,  # (B,) int64
    N,
    stride_v,
    stride_i,
    SORTED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    INTERPRET: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # cdiv(N, BLOCK_V), used by the interpreter only
):
    row = tl.program_id(0).to(tl.int64)
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
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.full((), 0, tl.int32)
    # compiled: the loop stops at the kept prefix (a loaded bound); the interpreter takes no tensor loop bound,
    # so it walks all NUM_CHUNKS chunks (the masks make the result identical)
    for start in range(0, NUM_CHUNKS * BLOCK_V if INTERPRET else n, BLOCK_V):
        idx = start + cols
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
    if SORTED:
        token = tl.load(ids_ptr + row * stride_i + best_at)
    else:
        token = best_at.to(tl.int64)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(step_ptr + row, step + 1)


def launch_sample(values: torch.Tensor, ids: torch.Tensor | None, n_keep: torch.Tensor | None,
                  temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, out: torch.Tensor, *,
                  interpreter: bool = False) -> torch.Tensor:
    """values (B, N) float, unit column stride; ids (B, N) int64 + n_keep (B,) int32 for sorted candidates (both
    or neither); temperature (B,) fp32, seed / step (B,) int64 contiguous; out (B,) int64. Increments step."""
    num_rows, n = values.shape
    if num_rows == 0:
        return out
    cfg = INTERPRETER_CONFIG if interpreter else SAMPLE_CONFIG
    sorted_ = ids is not None
    _sample_kernel[(num_rows,)](
        values, ids if sorted_ else seed, n_keep if sorted_ else seed, temperature, seed, step, out, n,
        values.stride(0), ids.stride(0) if sorted_ else 0, SORTED=sorted_, BLOCK_V=cfg["BLOCK_V"],
        INTERPRET=interpreter, NUM_CHUNKS=triton.cdiv(n, cfg["BLOCK_V"]) if interpreter else 1,
        num_warps=cfg["num_warps"],
    )
    return out
