"""L2 prefetch of byte regions (Hopper's ``cp.async.bulk.prefetch.L2``): a hint that pulls weights into L2
before the kernel that reads them runs, with no registers held and nothing waited for.

Why: in a 1-token MoE step the HBM is idle or half used for long stretches (the route launch's ~9 us, the
GEMMs' prologues, tails and the launch gaps between them, issue 11) while the expert GEMMs after it are bound by
the HBM. Bytes that an earlier phase pulls into L2 are bytes the GEMM does not wait for.

The one device helper, :func:`prefetch_l2_share` (Triton) / :func:`gl_prefetch_l2_share` (Gluon): program
``part`` of ``parts`` prefetches its share of the region ``[base, base + nbytes)``, split over its warps (one bulk
prefetch per warp: the instruction takes warp-uniform operands, so per-thread addresses would make the compiler
loop over the 32 lanes). The shares tile ``[0, nbytes16)``
exactly, ``nbytes16 = nbytes // 16 * 16`` (a bulk copy moves multiples of 16 bytes from a 16-byte aligned
address: the region's base must be 16-byte aligned, :func:`prefetchable`; the last ``nbytes % 16`` bytes are not
prefetched). :func:`prefetch_shares_reference` is the same arithmetic in Python (tests).

``EVICT_LAST``: the prefetched lines carry the L2 ``evict_last`` policy (``createpolicy.fractional``), so that a
stream of other data through L2 before their reader runs evicts them last.

A prefetch never changes a result: it reads memory that the kernel's caller says is valid and writes nothing
visible. In the Triton interpreter the prefetch is a no-op (the share arithmetic still runs).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language import core

from .pdl import _compiled_only

#: The bulk prefetch's granule: the base address and every share are multiples of it.
PREFETCH_ALIGN = 16

_ASM_PLAIN = """{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
_ASM_EVICT_LAST = """{
.reg .pred p;
.reg .b64 pol;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}"""


_ASM_LINE = "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;"
_ASM_LINE_EVICT_LAST = "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;"

#: How the helpers prefetch: False = one bulk prefetch per warp (``cp.async.bulk.prefetch.L2``), True = one
#: ``prefetch.global.L2`` per 128-byte line, the lines spread over the threads (read by the launchers, passed to the
#: kernels as their ``PF_LINES`` constexpr).
PREFETCH_LINES = os.environ.get("MEGAMOE_L2_PREFETCH_LINES", "0").strip() == "1"


def prefetchable(t: torch.Tensor | None) -> bool:
    """Whether ``t`` can be a prefetch region: a contiguous CUDA tensor with a 16-byte aligned base (host metadata)."""
    return (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and t.numel() > 0
            and t.data_ptr() % PREFETCH_ALIGN == 0)


def prefetch_shares_reference(nbytes: int, parts: int, pieces: int) -> list[list[tuple[int, int]]]:
    """The kernels' split in Python: for each part, its pieces' (one per warp) (start, size) (size 0: nothing)."""
    n16 = nbytes // 16 * 16
    per_part = -(-(-(-n16 // parts)) // 16) * 16
    per_piece = -(-(-(-per_part // pieces)) // 16) * 16
    out = []
    for part in range(parts):
        lo, hi = part * per_part, min(part * per_part + per_part, n16)
        out.append([(lo + i * per_piece, max(min(lo + i * per_piece + per_piece, hi) - lo - i * per_piece, 0))
                    for i in range(pieces)])
    return out


@_compiled_only
def _bulk_prefetch(ptrs, sizes, evict_last, _semantic=None):
    """One ``cp.async.bulk.prefetch.L2`` per element (size > 0), fire and forget."""
    asm = _ASM_EVICT_LAST if core._unwrap_if_constexpr(evict_last) else _ASM_PLAIN
    core.inline_asm_elementwise(asm, "=r,l,r", [ptrs, sizes], dtype=core.int32, is_pure=False, pack=1,
                                _semantic=_semantic)


@_compiled_only
def _line_prefetch(ptrs, evict_last, _semantic=None):
    """One ``prefetch.global.L2`` per element."""
    asm = _ASM_LINE_EVICT_LAST if core._unwrap_if_constexpr(evict_last) else _ASM_LINE
    core.inline_asm_elementwise(asm, "=r,l", [ptrs], dtype=core.int32, is_pure=False, pack=1, _semantic=_semantic)


@triton.jit
def prefetch_piece_bounds(nbytes, part, parts, piece, PIECES: tl.constexpr):
    """(start int64, size int32) of ``piece`` (of ``PIECES``) of program ``part``'s share (of ``parts``) of an
    ``nbytes`` region (:func:`prefetch_shares_reference`; the Gluon twin repeats this arithmetic)."""
    n16 = nbytes.to(tl.int64) // 16 * 16
    per_part = ((n16 + parts - 1) // parts + 15) // 16 * 16
    per_piece = ((per_part + PIECES - 1) // PIECES + 15) // 16 * 16
    lo = part.to(tl.int64) * per_part
    hi = tl.minimum(lo + per_part, n16)
    start = lo + piece.to(tl.int64) * per_piece
    return start, tl.maximum(tl.minimum(start + per_piece, hi) - start, 0).to(tl.int32)


@triton.jit
def prefetch_l2_share(base_ptr, nbytes, part, parts, LANES: tl.constexpr, EVICT_LAST: tl.constexpr,
                      LINES: tl.constexpr = False):
    """Prefetch program ``part``'s share (of ``parts``) of ``[base_ptr, base_ptr + nbytes)`` bytes into L2, one
    bulk prefetch per warp; ``LANES`` = the program's thread count (element i of a LANES-long vector is thread i's,
    so the 32 lanes of a warp hold the same piece). ``base_ptr`` 16-byte aligned."""
    base = base_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    if LINES:  # the share's 128-byte lines, thread t taking lines t, t + LANES, ...
        n16 = nbytes.to(tl.int64) // 16 * 16
        per_part = ((n16 + parts - 1) // parts + 15) // 16 * 16
        lo = part.to(tl.int64) * per_part
        hi = tl.minimum(lo + per_part, n16)
        line = tl.arange(0, LANES).to(tl.int64) * 128
        off = lo
        while off < hi:
            at = off + line
            _line_prefetch(base + tl.where(at < hi, at, lo), EVICT_LAST)
            off += 128 * LANES
    else:
        start, size = prefetch_piece_bounds(nbytes, part, parts, tl.arange(0, LANES) // 32, LANES // 32)
        _bulk_prefetch(base + start, size, EVICT_LAST)


try:  # the Gluon twin (the same PTX through Gluon's inline asm)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _GL_ASM_PLAIN = gl.constexpr(_ASM_PLAIN)  # a jitted function reads module globals only as constexprs
    _GL_ASM_EVICT_LAST = gl.constexpr(_ASM_EVICT_LAST)
    _GL_ASM_LINE = gl.constexpr(_ASM_LINE)
    _GL_ASM_LINE_EVICT_LAST = gl.constexpr(_ASM_LINE_EVICT_LAST)

    @gluon.jit
    def gl_prefetch_l2_share(base_ptr, nbytes, part, parts, num_warps: gl.constexpr, EVICT_LAST: gl.constexpr,
                             LINES: gl.constexpr = False):
        """:func:`prefetch_l2_share` in a Gluon kernel of ``num_warps`` warps (one bulk prefetch per warp)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        lane = gl.arange(0, 32 * num_warps, layout=layout)
        n16 = nbytes.to(gl.int64) // 16 * 16
        per_part = ((n16 + parts - 1) // parts + 15) // 16 * 16
        lo = part.to(gl.int64) * per_part
        hi = gl.minimum(lo + per_part, n16)
        base = base_ptr.to(gl.pointer_type(gl.uint8), bitcast=True)
        if LINES:
            line = lane.to(gl.int64) * 128
            off = lo
            while off < hi:
                at = off + line
                if EVICT_LAST:
                    gl.inline_asm_elementwise(_GL_ASM_LINE_EVICT_LAST, "=r,l", [base + gl.where(at < hi, at, lo)],
                                              dtype=gl.int32, is_pure=False, pack=1)
                else:
                    gl.inline_asm_elementwise(_GL_ASM_LINE, "=r,l", [base + gl.where(at < hi, at, lo)],
                                              dtype=gl.int32, is_pure=False, pack=1)
                off += 128 * 32 * num_warps
        else:
            per_piece = ((per_part + num_warps - 1) // num_warps + 15) // 16 * 16
            start = lo + (lane // 32).to(gl.int64) * per_piece
            size = gl.maximum(gl.minimum(start + per_piece, hi) - start, 0).to(gl.int32)
            ptrs = base + start
            if EVICT_LAST:
                gl.inline_asm_elementwise(_GL_ASM_EVICT_LAST, "=r,l,r", [ptrs, size], dtype=gl.int32, is_pure=False,
                                          pack=1)
            else:
                gl.inline_asm_elementwise(_GL_ASM_PLAIN, "=r,l,r", [ptrs, size], dtype=gl.int32, is_pure=False,
                                          pack=1)
except ImportError:  # no Gluon in this Triton
    gl_prefetch_l2_share = None
