"""Exact top-k indices of float32 score rows (the V4 indexer's selection): sort or bucket select.

Output (bit for bit ``megamoe.reference.kvcache.select_topk``): the ``K = min(k, T)`` entries with the largest
scores, best first, ties to the lower index, ``-0.0 == +0.0``, NaN above ``+inf`` (after ``x + 0.0``, as the
reference), ``-1`` where the selected score is ``-inf``.

Each score becomes the reference's order-preserving int32 key ``o`` (``bits ^ 0x7FFFFFFF`` for negative bits)
and each entry the unique int64 ``(o << 32) | (T - 1 - index)``: larger is better, so the answer is the K
largest of these, sorted descending. Three paths, chosen per shape by the table ``PLAN`` (host, shapes only):

"sort" (v3; short rows, and always when K == T): one program packs the whole row (padded to a power of
two) and sorts it in registers (bitonic ``tl.sort``); the first K are stored. One launch, no scratch.

"row" (v1; large batches): one program per row, the row streaming through L1 in CHUNKs:
A+B. one pass: the row maximum key and an NB-bin histogram of ``_bucket(o, ref)`` (log-linear below
   ``ref`` = the first chunk's maximum; -inf has its own bucket). Buckets are monotone in ``o``: the cumulative
   sum finds the bucket b* holding the K-th best; everything in a better bucket is selected ("sure") and
   the ``need`` best of bucket b* complete the answer. If b* is bucket 0 (more than K entries near or above
   ``ref``: e.g. ascending rows), the histogram is rebuilt below the row maximum. b* = the -inf bucket is
   exact at once (rows with fewer than K finite scores).
B'. only while b* holds more than CAP entries and more than one distinct key (outlier maximum, dense ties):
   a min/max pass, then 64-bin linear histograms over the row narrow an exact key range [lo, hi].
C. one pass: indices of sure entries are appended (block cumsum, index order) to scratch ``sel`` (K_P2
   int32), of candidates (bucket b*, key in [lo, hi]; the first CAP, which are all needed when they are
   all equal) to scratch ``cand`` (CAP int32).
D+E (``_finish``). v3: when sure + candidates are at most FIN (= ``fin`` x K_P2), one sort of all of them
   and the first K stored (they hold the K best: all better buckets and the whole threshold range). Else
   v1: the candidates' keys are re-gathered; 64-bin linear histograms find the exact threshold key;
   candidates above it and the ``need`` lowest-index ones equal to it are appended to ``sel``; the K
   selected entries are gathered, packed, sorted descending, decoded.

"split" (v2-v4; small batches): the row is cut into P spans, one program each, four launches (S1 span
maxima, skipped when the indexer kernel wrote its tile maxima into the workspace; S2 span histograms merged
by the last-arriving program; S3 span compaction; v4: S4 ranks U = every entry of a better bucket and of the
threshold bucket (it holds every entry better than any of its members, so its ranks are the row's ranks)
over many programs, each winner stored at ``out[rank]``: no threshold search, no sort). Rows whose U is
too large fall back to v3 (S3's last-arriving program runs D+E, or S2's runs the whole row). See the kernels.

Row loops are while loops (the interpreter cannot range() over a runtime int). Everything after the launch
is data-dependent control flow inside the program (no host sync). Scratch is global memory written and
re-read by the same program after a CTA barrier (the re-reads use ``.cg``: L2, never a stale L1 line).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_enabled

#: The order-preserving int32 key of -inf (``0xFF800000 ^ 0x7FFFFFFF`` as int32; literal in the kernels).
NEG_INF_KEY = -2139095041
#: v5 first-histogram buckets: negative scores of a row whose reference is positive are bucketed by binades
#: of |x| from ref / 2**NEG_OCT (below that: one bucket) up to the last bucket (NB = 256: 8.5 binades).
NEG_OCT = tl.constexpr(8)


@triton.jit
def _ordered(x):
    """float32 -> order-preserving int32 (the reference's map; ``+ 0.0`` makes -0.0 equal +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _bucket(o, ref, NB: tl.constexpr):
    """Bucket in [0, NB - 1] of key ``o`` (int32), non-increasing in ``o``: 0 for ``o > ref - 256``,
    then log-linear in the key distance ``d = (ref - o) >> 8`` (NB = 128: 4 buckets per octave, NB = 256: 8;
    d < 2**24 converts to float32 exactly), NB - 2 for -inf, NB - 1 below -inf (negative-signed NaN, CPU only).
    v5: when ``ref > 0`` the negative scores get their own buckets above every positive one (distance buckets
    of ``o >= 0`` are <= 23 << SUB): ``NEG0 = (23 << SUB) + 1`` for ``|x| < ref / 2**NEG_OCT`` (as floats),
    then 8 (NB = 128: 4) per binade of ``|x|`` up to the clamp at NB - 3. The distance buckets alone put every
    negative score of such a row into one or two buckets (key distances >= ref ~ 2**30, buckets 2**27 keys
    wide = 16 binades), so a row whose K-th best is slightly below zero had its whole negative half in b*."""
    SUB: tl.constexpr = 2 if NB == 128 else 3
    NEG0: tl.constexpr = (23 << SUB) + 1
    d = ((ref - o).to(tl.uint32, bitcast=True) >> 8).to(tl.int32)  # ref >= o: the wrapped difference
    # d = 1 -> float32 bits 127 << 23 -> bucket 1
    b = (d.to(tl.float32).to(tl.int32, bitcast=True) >> (23 - SUB)) - ((127 << SUB) - 1)
    b = tl.minimum(tl.maximum(b, 0), NB - 3)
    # negative scores of a row with a positive reference: ~o = bits of |x|, linear in the float's log
    c0 = tl.maximum(ref - (NEG_OCT << 23), 0)
    bn = NEG0 + tl.minimum(tl.maximum(((~o - c0) >> (23 - SUB)) + 1, 0), NB - 3 - NEG0)
    b = tl.where((o < 0) & (ref > 0), bn, b)
    b = tl.where(o > ref, 0, b)
    b = tl.where(o == -2139095041, NB - 2, b)
    return tl.where(o < -2139095041, NB - 1, b)


@triton.jit
def _find_bucket(h, need, NB: tl.constexpr):
    """h: (NB,) counts, best bucket first; 1 <= ``need`` <= sum(h). Returns (bucket holding the
    need-th best, count in better buckets, count in that bucket)."""
    cum = tl.cumsum(h, 0)
    b = tl.sum((cum < need).to(tl.int32), 0)
    bins = tl.arange(0, NB)
    before = tl.sum(tl.where(bins < b, h, 0), 0)
    cnt = tl.sum(tl.where(bins == b, h, 0), 0)
    return b, before, cnt


@triton.jit
def _shift(lo, hi):
    """Smallest s with ``(hi - lo) >> s < 64`` (int64 scalars): 64 linear buckets of 2**s keys cover [lo, hi]."""
    width = hi - lo
    s = tl.zeros([], tl.int32)
    while (width >> s) >= 64:
        s += 1
    return s


@triton.jit
def _distance(o, hi, s):
    """Linear bucket ``(hi - o) >> s`` of keys ``o <= hi`` (the wrapped int32 difference is the distance)."""
    return ((hi.to(tl.int32) - o).to(tl.uint32, bitcast=True) >> s.to(tl.uint32)).to(tl.int32)


@triton.jit
def _narrow(h, lo, hi, s, need):
    """After a 64-bin histogram of ``_distance``: the bucket holding the need-th best inside [lo, hi]
    becomes the new range. Returns (lo, hi, need, count in the new range)."""
    b, before, cnt = _find_bucket(h, need, 64)
    new_hi = hi - (b.to(tl.int64) << s.to(tl.int64))
    new_lo = tl.maximum(lo, new_hi - (tl.full([], 1, tl.int64) << s.to(tl.int64)) + 1)
    return new_lo, new_hi, need - before, cnt


@triton.jit
def _load_keys(src, idx, T):
    return _ordered(tl.load(src + idx, mask=idx < T, other=0.0))


@triton.jit
def _pack(o, idx, T):
    return (o.to(tl.int64) << 32) | (T - 1 - idx).to(tl.int64)


@triton.jit
def _row_histogram(src, T, ref, CHUNK: tl.constexpr, NB: tl.constexpr):
    """Bucket histogram of a row (padding counted in bucket NB - 1 and removed) and its maximum key."""
    lane = tl.arange(0, CHUNK)
    h = tl.zeros([NB], tl.int32)
    mx = tl.full([CHUNK], -2147483648, tl.int32)
    start = 0
    while start < T:
        idx = start + lane
        live = idx < T
        o = _load_keys(src, idx, T)
        mx = tl.maximum(mx, tl.where(live, o, -2147483648))
        h += tl.histogram(tl.where(live, _bucket(o, ref, NB), NB - 1), NB)
        start += CHUNK
    pad = tl.cdiv(T, CHUNK) * CHUNK - T
    h -= tl.where(tl.arange(0, NB) == NB - 1, pad, 0)
    return h, tl.max(mx, 0)


@triton.jit
def _compact(src, sel_ptr, cand_ptr, T, begin, end, ref, bstar, lo, hi, n_sel, n_cand,
             CAP: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr):
    """C over entries [begin, end): indices of sure entries appended to sel from position n_sel, of
    candidates (bucket b*, key in [lo, hi]; positions < CAP) to cand from n_cand, in index order."""
    lane = tl.arange(0, CHUNK)
    lo32 = lo.to(tl.int32)
    hi32 = hi.to(tl.int32)
    start = begin
    while start < end:
        idx = start + lane
        live = idx < end
        o = _load_keys(src, idx, T)
        bkt = _bucket(o, ref, NB)
        inb = live & (bkt == bstar)
        sure = (live & (bkt < bstar)) | (inb & (o > hi32))
        cand = inb & (o >= lo32) & (o <= hi32)
        code = sure.to(tl.int32) + (cand.to(tl.int32) << 16)  # CHUNK < 2**16: two counts in one scan
        incl = tl.cumsum(code, 0)
        pos_s = n_sel + (incl & 0xFFFF) - sure.to(tl.int32)
        pos_c = n_cand + (incl >> 16) - cand.to(tl.int32)
        tl.store(sel_ptr + pos_s, idx, mask=sure)
        tl.store(cand_ptr + pos_c, idx, mask=cand & (pos_c < CAP))
        tot = tl.sum(code, 0)
        n_sel += tot & 0xFFFF
        n_cand += tot >> 16
        start += CHUNK
    return n_sel, n_cand


@triton.jit
def _finish(src, dst, sel_ptr, cand_ptr, T, n_sel, n_cand, need, K,
            K_P2: tl.constexpr, CAP: tl.constexpr, FIN: tl.constexpr):
    """D + E: the K best among the ``n_sel`` sure entries (``sel``) and the first ``min(n_cand, CAP)``
    (index-ordered) candidates (``cand``), sorted and stored (-1 for -inf). Returns 1 when they were found
    by one sort of sure + candidates (v3: ``FIN > 0`` and at most FIN of them), 0 for the D steps (exact
    threshold by 64-bin linear histograms, the ``need`` lowest-index ties) + a sort of the K winners."""
    nc = tl.minimum(n_cand, CAP)
    by_sort = 0
    if FIN > 0:  # (constexpr: no FIN-sized code when disabled)
        if n_sel + nc <= FIN:
            by_sort = 1
            # sure + candidates hold the K best (every entry of a better bucket, the whole threshold range):
            # their unique packed keys sorted descending put exactly the K best first
            offs = tl.arange(0, FIN)
            in_sel = offs < n_sel
            in_cand = (offs >= n_sel) & (offs < n_sel + nc)
            a = tl.load(sel_ptr + offs, mask=in_sel, other=0, cache_modifier=".cg")
            b = tl.load(cand_ptr + (offs - n_sel), mask=in_cand, other=0, cache_modifier=".cg")
            idx = tl.where(in_sel, a, b)
            p = _pack(_load_keys(src, idx, T), idx, T)
            p = tl.sort(tl.where(in_sel | in_cand, p, -9223372036854775807 - 1), descending=True)
            _store_sorted(dst, p, T, K, FIN)
    if by_sort == 0:
        coffs = tl.arange(0, CAP)
        valid = coffs < nc
        cidx = tl.load(cand_ptr + coffs, mask=valid, other=0, cache_modifier=".cg")
        co = _load_keys(src, cidx, T)
        lo = tl.min(tl.where(valid, co, 2147483647), 0).to(tl.int64)
        hi = tl.max(tl.where(valid, co, -2147483648), 0).to(tl.int64)
        while lo < hi:
            s = _shift(lo, hi)
            member = valid & (co >= lo.to(tl.int32)) & (co <= hi.to(tl.int32))
            hd = tl.histogram(tl.where(member, _distance(co, hi, s), 0), 64, mask=member)
            lo, hi, need, cnt = _narrow(hd, lo, hi, s, need)
        thr = hi.to(tl.int32)
        eq = valid & (co == thr)
        rank_eq = tl.cumsum(eq.to(tl.int32), 0) - eq.to(tl.int32)
        take = (valid & (co > thr)) | (eq & (rank_eq < need))
        pos = n_sel + tl.cumsum(take.to(tl.int32), 0) - take.to(tl.int32)
        tl.store(sel_ptr + pos, cidx, mask=take)
        tl.debug_barrier()

        offs = tl.arange(0, K_P2)
        sidx = tl.load(sel_ptr + offs, mask=offs < K, other=0, cache_modifier=".cg")
        p = _pack(_load_keys(src, sidx, T), sidx, T)
        p = tl.sort(tl.where(offs < K, p, -9223372036854775807 - 1), descending=True)
        _store_sorted(dst, p, T, K, K_P2)
    return by_sort


@triton.jit
def _store_sorted(dst, p, T, K, N: tl.constexpr):
    """The first K of N sorted packed keys -> indices (-1 for -inf)."""
    offs = tl.arange(0, N)
    key = (p >> 32).to(tl.int32)
    index = T - 1 - p.to(tl.int32)
    tl.store(dst + offs, tl.where(key == -2139095041, -1, index), mask=offs < K)


@triton.jit
def _row_topk(src, dst, sel_ptr, cand_ptr, T, K,
              K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
              NB: tl.constexpr, FIN: tl.constexpr):
    """The whole v1 selection of one row by one program (K < T)."""
    lane = tl.arange(0, CHUNK)
    # ---- A+B: histogram of buckets below the first chunk's maximum (and the row maximum)
    o0 = _load_keys(src, lane, T)
    ref = tl.max(tl.where(lane < T, o0, -2147483648), 0)
    h, m = _row_histogram(src, T, ref, CHUNK, NB)
    bstar, before, count = _find_bucket(h, K, NB)
    if bstar == 0:
        # more than K entries near or above the first chunk's maximum: rebuild below the row maximum
        ref = m
        h, m = _row_histogram(src, T, ref, CHUNK, NB)
        bstar, before, count = _find_bucket(h, K, NB)
    need = K - before
    # candidates: bucket b* and key in [lo, hi]; everything better is selected
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    if bstar == NB - 2:
        lo = tl.full([], -2139095041, tl.int64)  # the K-th best is -inf
        hi = lo
    elif count > CAP:
        # ---- B': too many candidates: exact key range of b*, then linear steps over the row
        kmin = tl.full([CHUNK], 2147483647, tl.int32)
        kmax = tl.full([CHUNK], -2147483648, tl.int32)
        start = 0
        while start < T:
            idx = start + lane
            o = _load_keys(src, idx, T)
            member = (idx < T) & (_bucket(o, ref, NB) == bstar)
            kmin = tl.minimum(kmin, tl.where(member, o, 2147483647))
            kmax = tl.maximum(kmax, tl.where(member, o, -2147483648))
            start += CHUNK
        lo = tl.min(kmin, 0).to(tl.int64)
        hi = tl.max(kmax, 0).to(tl.int64)
        while (count > CAP) & (lo < hi):
            s = _shift(lo, hi)
            hl = tl.zeros([64], tl.int32)
            start = 0
            while start < T:
                idx = start + lane
                o = _load_keys(src, idx, T)
                member = ((idx < T) & (_bucket(o, ref, NB) == bstar) & (o >= lo.to(tl.int32))
                          & (o <= hi.to(tl.int32)))
                hl += tl.histogram(tl.where(member, _distance(o, hi, s), 0), 64, mask=member)
                start += CHUNK
            lo, hi, need, count = _narrow(hl, lo, hi, s, need)

    # ---- C: append the indices of sure entries to sel, of candidates (first CAP) to cand, in order
    zero = tl.zeros([], tl.int32)
    n_sel, n_cand = _compact(src, sel_ptr, cand_ptr, T, 0, T, ref, bstar, lo, hi, zero, zero, CAP, CHUNK, NB)
    tl.debug_barrier()
    # ---- D + E
    return _finish(src, dst, sel_ptr, cand_ptr, T, n_sel, n_cand, need, K, K_P2, CAP, FIN)


@triton.jit(do_not_specialize=["T", "scratch_stride", "K"])
def _topk_kernel(scores_ptr, out_ptr, scratch_ptr, T, scratch_stride, K,
                 K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                 SORT_N: tl.constexpr, NB: tl.constexpr = 128, FIN: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One program per row. ``SORT_N > 0`` (v3 "sort" path, T <= SORT_N): the whole row packed and sorted
    in registers, the first K stored (no scratch). Else the v1 bucket select (K < T)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * T
    dst = out_ptr + row * K
    if SORT_N > 0:
        offs = tl.arange(0, SORT_N)
        p = _pack(_load_keys(src, offs, T), offs, T)
        p = tl.sort(tl.where(offs < T, p, -9223372036854775807 - 1), descending=True)
        _store_sorted(dst, p, T, K, SORT_N)
    else:
        sel_ptr = scratch_ptr + row * scratch_stride  # K_P2 int32 indices of the selected entries
        cand_ptr = sel_ptr + K_P2                     # CAP int32 indices of the candidates
        _row_topk(src, dst, sel_ptr, cand_ptr, T, K, K_P2, CAP, CHUNK, NB, FIN)


# ---------------------------------------------------------------- v2-v4: rows split over P programs
# Per-row int32 workspace of the split path (offsets from the row's base):
#   [0] arrival counter (0 between calls), [1] b*, [2] need, [3] mode (0: v4 rank finish by S4; 1: the whole
#   row selected by S2's merging program; 2: S3 index-ordered compaction + D steps), [4] reference (row
#   maximum key), [5] entries in bucket b*, [6] which finish ran (diagnostics: 2 rank, 0 D steps; mode 1:
#   the row finish's own flag), [7] n_U (entries S4 ranks);
#   [16, 16 + MREG) row maxima: P span maxima (S1) or the indexer's tile maxima (S1 skipped);
#   then P x NB cumulative span histograms, P offsets (U, or sure entries in mode 2), P candidate offsets, sel (K_P2),
#   cand (CAP) (mode 2), then at UOFF the U keys (UMAX int32) and the U indices (UMAX int32) (mode 0).
_HDR = 16
#: The rank finish (mode 0) applies while U = sure + threshold bucket holds at most fin * K_P2 entries;
#: the workspace holds U for fin <= FIN_MAX.
FIN_MAX = 4


@triton.jit
def _span_bounds(p, T, SPAN):
    begin = p * SPAN
    return begin, tl.minimum(begin + SPAN, T)


@triton.jit(do_not_specialize=["T", "ws_stride", "SPAN"])
def _split_max_kernel(scores_ptr, ws_ptr, T, ws_stride, SPAN, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """S1, grid (B, P): the maximum key of each program's span of the row."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    src = scores_ptr + row * T
    begin, end = _span_bounds(p, T, SPAN)
    lane = tl.arange(0, CHUNK)
    mx = tl.full([CHUNK], -2147483648, tl.int32)
    start = begin
    while start < end:
        idx = start + lane
        o = _load_keys(src, idx, T)
        mx = tl.maximum(mx, tl.where(idx < end, o, -2147483648))
        start += CHUNK
    tl.store(ws_ptr + row * ws_stride + 16 + p, tl.max(mx, 0))


@triton.jit
def _max_of(ptr, n, MCH: tl.constexpr):
    """Maximum of ``n`` int32 at ``ptr`` (INT_MIN when n == 0)."""
    lane = tl.arange(0, MCH)
    acc = tl.full([MCH], -2147483648, tl.int32)
    i = 0
    while i < n:
        acc = tl.maximum(acc, tl.load(ptr + i + lane, mask=i + lane < n, other=-2147483648))
        i += MCH
    return tl.max(acc, 0)


@triton.jit(do_not_specialize=["T", "ws_stride", "SPAN", "P", "NMAX", "MREG", "K", "UCAP"])
def _split_hist_kernel(scores_ptr, out_ptr, ws_ptr, T, ws_stride, SPAN, P, NMAX, MREG, K, UCAP,
                       K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr, ROW_CHUNK: tl.constexpr,
                       NB: tl.constexpr, MCH: tl.constexpr, PCH: tl.constexpr, PV: tl.constexpr,
                       PDL: tl.constexpr = False):
    """S2, grid (B, P): NB-bin histogram of each span below the exact row maximum (the maximum of the NMAX
    maxima at ws[16:]: S1's span maxima or the indexer's tile maxima); the last program of the row to
    arrive merges them in program order (PCH spans at a time): b*, need, the mode, and per-program output
    offsets. Mode 0 (v4) when U = every entry of a better bucket and of b* (only the better ones when b* is
    the -inf bucket) has at most UCAP entries: offsets of U per span. Else as v3: offsets of sure entries
    and candidates in index order (mode 2), or, with more than CAP candidates in b* (dense ties, not the
    -inf bucket), the merging program runs the whole v1 selection of the row (mode 1)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    src = scores_ptr + row * T
    ws = ws_ptr + row * ws_stride
    ref = _max_of(ws + 16, NMAX, MCH)
    begin, end = _span_bounds(p, T, SPAN)
    lane = tl.arange(0, CHUNK)
    h = tl.zeros([NB], tl.int32)
    start = begin
    while start < end:
        idx = start + lane
        live = idx < end
        o = _load_keys(src, idx, T)
        h += tl.histogram(tl.where(live, _bucket(o, ref, NB), 0), NB, mask=live)
        start += CHUNK
    hist = ws + 16 + MREG  # (P, NB) cumulative span histograms
    bins = tl.arange(0, NB)
    tl.store(hist + p * NB + bins, tl.cumsum(h, 0))
    tl.debug_barrier()
    arrived = tl.atomic_add(ws, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:
        tl.debug_barrier()
        pp = tl.arange(0, PCH)
        cum = tl.zeros([NB], tl.int32)
        q = 0
        while q < P:
            cp = tl.load(hist + (q + pp)[:, None] * NB + bins[None, :], mask=(q + pp < P)[:, None], other=0,
                         cache_modifier=".cg")
            cum += tl.sum(cp, 0)
            q += PCH
        bstar = tl.sum((cum < K).to(tl.int32), 0)  # the bucket of the K-th best
        before = tl.sum(tl.where(bins == bstar - 1, cum, 0), 0)
        count = tl.sum(tl.where(bins == bstar, cum, 0), 0) - before
        need = K - before
        n_u = tl.where(bstar == NB - 2, before, before + count)
        mode = tl.where((n_u <= UCAP) & (bstar != NB - 1), 0,
                        tl.where((count > CAP) & (bstar != NB - 2), 1, 2))
        ub = tl.where((mode == 0) & (bstar != NB - 2), bstar + 1, bstar)  # U (mode 0) / sure: buckets < ub
        # per-span counts from two columns of the cumulative histograms: entries in buckets < ub, in b*
        offs_ptr = hist + P * NB
        carry_u = tl.zeros([], tl.int32)
        carry_c = tl.zeros([], tl.int32)
        pv = tl.arange(0, PV)
        q = 0
        while q < P:
            m = q + pv < P
            rows = hist + (q + pv) * NB
            u_p = tl.load(rows + ub - 1, mask=m & (ub > 0), other=0, cache_modifier=".cg")
            c_lo = tl.load(rows + bstar - 1, mask=m & (bstar > 0), other=0, cache_modifier=".cg")
            c_p = tl.load(rows + bstar, mask=m, other=0, cache_modifier=".cg") - c_lo
            tl.store(offs_ptr + q + pv, carry_u + tl.cumsum(u_p, 0) - u_p, mask=m)
            tl.store(offs_ptr + P + q + pv, carry_c + tl.cumsum(c_p, 0) - c_p, mask=m)
            carry_u += tl.sum(u_p, 0)
            carry_c += tl.sum(c_p, 0)
            q += PV
        tl.store(ws + 1, bstar)
        tl.store(ws + 2, need)
        tl.store(ws + 3, mode)
        tl.store(ws + 4, ref)
        tl.store(ws + 5, count)
        tl.store(ws + 6, tl.where(mode == 0, 2, 0))
        tl.store(ws + 7, n_u)
        tl.store(ws, 0)  # counter back to 0 for S3 and the next call
        if mode == 1:
            sel_ptr = offs_ptr + 2 * P
            by_sort = _row_topk(src, out_ptr + row * K, sel_ptr, sel_ptr + K_P2, T, K, K_P2, CAP, ROW_CHUNK,
                                NB, 0)
            tl.store(ws + 6, by_sort)


@triton.jit(do_not_specialize=["T", "ws_stride", "SPAN", "P", "MREG", "K", "UOFF", "UMAX"])
def _split_select_kernel(scores_ptr, out_ptr, ws_ptr, T, ws_stride, SPAN, P, MREG, K, UOFF, UMAX,
                         K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr,
                         PDL: tl.constexpr = False):
    """S3, grid (B, P). Mode 0 (v4): each span appends the keys and indices of its U entries at its offset
    (no ordering needed: S4 ranks unique packed keys). Mode 2 (v3): each span appends its sure entries and
    candidates at the offsets of S2 (index order, as v1); the last program of the row to arrive runs v1's
    D + E. Mode 1: nothing (S2 finished the row)."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    src = scores_ptr + row * T
    ws = ws_ptr + row * ws_stride
    mode = tl.load(ws + 3)
    ref = tl.load(ws + 4)
    bstar = tl.load(ws + 1)
    offs_ptr = ws + 16 + MREG + P * NB
    begin, end = _span_bounds(p, T, SPAN)
    if mode == 0:
        ukey = ws + UOFF
        uidx = ukey + UMAX
        ub = tl.where(bstar == NB - 2, bstar, bstar + 1)
        lane = tl.arange(0, CHUNK)
        n = tl.load(offs_ptr + p)
        start = begin
        while start < end:
            idx = start + lane
            o = _load_keys(src, idx, T)
            u = (idx < end) & (_bucket(o, ref, NB) < ub)
            ui = u.to(tl.int32)
            pos = n + tl.cumsum(ui, 0) - ui
            tl.store(ukey + pos, o, mask=u)
            tl.store(uidx + pos, idx, mask=u)
            n += tl.sum(ui, 0)
            start += CHUNK
    elif mode == 2:
        need = tl.load(ws + 2)
        sel_ptr = offs_ptr + 2 * P
        cand_ptr = sel_ptr + K_P2
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        _compact(src, sel_ptr, cand_ptr, T, begin, end, ref, bstar, lo, hi,
                 tl.load(offs_ptr + p), tl.load(offs_ptr + P + p), CAP, CHUNK, NB)
        tl.debug_barrier()
        arrived = tl.atomic_add(ws, 1, sem="acq_rel", scope="gpu")
        if arrived == P - 1:
            tl.debug_barrier()
            tl.store(ws, 0)
            n_cand = tl.load(ws + 5)  # every entry of bucket b* (S2's merged count)
            by_sort = _finish(src, out_ptr + row * K, sel_ptr, cand_ptr, T, K - need, n_cand, need, K,
                              K_P2, CAP, 0)
            tl.store(ws + 6, by_sort)


@triton.jit(do_not_specialize=["T", "K", "ws_stride", "UOFF", "UMAX"])
def _split_rank_kernel(out_ptr, ws_ptr, T, K, ws_stride, UOFF, UMAX, RCH: tl.constexpr, UT: tl.constexpr,
                       PDL: tl.constexpr = False):
    """S4 (v4), grid (B, cdiv(UCAP, RCH)), mode 0 only: program r ranks U entries [r * RCH, (r + 1) * RCH)
    against all n_U of U (count of larger unique packed keys, UT at a time) and stores each one whose rank
    is below K at ``out[rank]`` (-1 for -inf). U holds every entry better than any of its members, so its
    ranks are the row's ranks and the K best come out sorted (best first, ties to the lower index). Slots
    [n_U, K) (fewer finite entries than K: the K-th best is -inf) are set to -1."""
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    ws = ws_ptr + row * ws_stride
    if tl.load(ws + 3) == 0:
        n = tl.load(ws + 7)
        dst = out_ptr + row * K
        ukey = ws + UOFF
        uidx = ukey + UMAX
        c = r * RCH + tl.arange(0, RCH)
        tl.store(dst + c, tl.full([RCH], -1, tl.int32), mask=(c >= n) & (c < K))
        if r * RCH < n:
            xm = c < n
            xk = tl.load(ukey + c, mask=xm, other=0)
            xi = tl.load(uidx + c, mask=xm, other=0)
            x = _pack(xk, xi, T)
            lane = tl.arange(0, UT)
            acc = tl.zeros([RCH, UT], tl.int32)
            yk = tl.load(ukey + lane, mask=lane < n, other=0)
            yi = tl.load(uidx + lane, mask=lane < n, other=0)
            start = 0
            while start < n:
                nxt = start + UT + lane
                yk_next = tl.load(ukey + nxt, mask=nxt < n, other=0)  # issued before this tile's compares
                yi_next = tl.load(uidx + nxt, mask=nxt < n, other=0)
                y = tl.where(start + lane < n, _pack(yk, yi, T), -9223372036854775807 - 1)
                acc += (y[None, :] > x[:, None]).to(tl.int32)
                yk = yk_next
                yi = yi_next
                start += UT
            rank = tl.sum(acc, 1)
            tl.store(dst + rank, tl.where(xk == -2139095041, -1, xi), mask=xm & (rank < K))


# ---------------------------------------------------------------- host side: plan, workspace, launch
#: Tile configuration of the one-program-per-row paths (GPU, interpreter): CHUNK entries per streamed
#: tile, CAP candidate slots (>= K_P2), warps per program.
CONFIG = {"gpu": dict(chunk=4096, cap=2048, num_warps=16), "interpreter": dict(chunk=256, cap=512, num_warps=4)}
#: Split path: at most MAX_SPLIT programs per row, each span >= MIN_SPAN entries (the "auto" programs
#: rule), CHUNK entries per streamed tile (one value for every shape: one compiled kernel per K_P2 class),
#: PCH span histograms summed per step by S2's merging program (one L2 round trip up to PCH programs per
#: row), PV spans per step of its offsets (two columns of the cumulative histograms); DEFAULT_SMS when no
#: CUDA device is visible. v4: spans >= 1024 (was 512): at batch 1 the passes are latency-bound, and
#: P <= 32 at 128k keeps the merge to two round trips.
SPLIT = {"gpu": dict(min_span=1024, max_split=128, chunk=1024, pch=32, pv=128),
         "interpreter": dict(min_span=64, max_split=8, chunk=64, pch=4, pv=4, num_warps=4)}  # GPU warps: split_warps
#: S4 (v4 rank finish): RCH U entries ranked per program against UT at a time, warps per program.
RANK = {"gpu": dict(rch=32, ut=256, num_warps=8), "interpreter": dict(rch=32, ut=64, num_warps=4)}
DEFAULT_SMS = 132


class Plan(NamedTuple):
    """How one shape is selected. path: "sort" (the whole row sorted in registers by one program; T <= the
    row's power of two), "row" (v1: bucket select, one program per row) or "split" (P programs per row,
    four launches, three with S1 skipped when the indexer wrote tile maxima). programs: split programs per
    row, 0 = auto (min(MAX_SPLIT, SMs // B, T // MIN_SPAN); below 2 -> "row"). warps: 0 = the path's
    default. fin (0..FIN_MAX): "row" finishes by one sort of sure + candidates when there are at most
    fin * K_P2 of them, "split" by the S4 rank finish when U (sure + threshold bucket) has at most fin * K_P2
    entries (0: the D steps always). bins: first-histogram buckets, 128 (4 per octave) or 256 (8 per
    octave)."""
    path: str
    programs: int = 0
    warps: int = 0
    fin: int = 2
    bins: int = 256


#: Per-shape plan, the first row with B <= b_max, T <= t_max and K in ks (None: any) wins. The GPU rows
#: are the ones to edit from ``python benchmarks/bench_topk.py --sweep`` (it prints a replacement).
PLAN = {
    "gpu": (
        # b_max, t_max, ks,  plan
        (None, 2048, None, Plan("sort", warps=8)),
        # batch 1 above the sort path: 8 warps and 128 first-histogram buckets (H100 sweep at 32768 entries,
        # results/topk_v5b_sweep.json: k 512 / 1024 12.8 / 13.7 us vs 13.5 / 14.8 with the row below; 8192 entries
        # checked by bench_topk --quick, results/gpu_check_v13b)
        (1, None, None, Plan("split", warps=8, fin=4, bins=128)),
        # auto programs; "row" once the batch fills the SMs. v5: fin=4 (U <= 4 * K_P2 ranked by S4: a row whose
        # K-th best is a small positive score has a coarse threshold bucket; the workspace holds FIN_MAX)
        (None, None, None, Plan("split", fin=4)),
    ),
    "interpreter": (
        (None, 128, None, Plan("sort", warps=4)),
        (None, None, None, Plan("split", fin=4)),
    ),
}


def plan_for(B: int, T: int, k: int, *, interpreter: bool = False, num_sms: int = DEFAULT_SMS,
             table=None) -> Plan:
    """The plan of a (B, T, K = min(k, T)) top-k (host, shapes only): the first matching row of ``table``
    (default ``PLAN``), with "split" programs resolved (auto rule; fewer than 2 -> "row") and the sort path
    kept only while T <= its power of two. K == T is always "sort"."""
    mode = "interpreter" if interpreter else "gpu"
    K = min(k, T)
    if K >= T:  # every entry: the sort path (its warps from the table's first "sort" row)
        return next((r[3] for r in (table or PLAN[mode]) if r[3].path == "sort"), Plan("sort"))
    for b_max, t_max, ks, plan in (table or PLAN[mode]):
        if (b_max is None or B <= b_max) and (t_max is None or T <= t_max) and (ks is None or K in ks):
            break
    else:
        plan = Plan("split")
    if plan.path == "split":
        cfg = SPLIT[mode]
        p = plan.programs or min(cfg["max_split"], num_sms // max(B, 1), T // cfg["min_span"])
        p = min(p, T // 16)  # spans of >= 16 entries
        # the row path's fin is its one-sort finish (fin * K_P2 int64 in registers): at most 2 there
        plan = plan._replace(programs=p) if p >= 2 else plan._replace(path="row", programs=1, fin=min(plan.fin, 2))
    return plan


def split_programs(B: int, T: int, k: int, *, interpreter: bool = False, num_sms: int = DEFAULT_SMS) -> int:
    """Programs per row that the plan gives (1 unless the path is "split")."""
    plan = plan_for(B, T, k, interpreter=interpreter, num_sms=num_sms)
    return plan.programs if plan.path == "split" else 1


def split_warps(K: int, *, interpreter: bool = False) -> int:
    """Default warps of the split kernels S1-S3: 16 (v4: S3 no longer holds the one-sort finish that spilled
    at 16 warps for K_P2 = 1024; the sm_90 compile test checks both K classes)."""
    if interpreter:
        return SPLIT["interpreter"]["num_warps"]
    return 16


def _tile_block(interpreter: bool) -> int:
    from .kvcache.indexer import BLOCK_T

    return BLOCK_T["interpreter" if interpreter else "gpu"]


def _k_cap(K: int, interpreter: bool, cap: int | None = None):
    k_p2 = max(16, triton.next_power_of_2(K))
    cap = max(triton.next_power_of_2(cap or CONFIG["interpreter" if interpreter else "gpu"]["cap"]), k_p2)
    return k_p2, cap


def _split_layout(T: int, K: int, programs: int, interpreter: bool, cap: int | None = None):
    """(MREG, UOFF, UMAX, int32 entries per row) of the split workspace (histograms sized for 256 bins, U
    for fin <= FIN_MAX)."""
    k_p2, cap = _k_cap(K, interpreter, cap)
    mreg = triton.cdiv(max(programs, triton.cdiv(T, _tile_block(interpreter))), 16) * 16
    uoff = _HDR + mreg + programs * 256 + 2 * programs + k_p2 + cap
    umax = FIN_MAX * k_p2
    return mreg, uoff, umax, uoff + 2 * umax


def workspace_entries(T: int, k: int, *, interpreter: bool = False, programs: int | None = None,
                      batch: int | None = None, cap: int | None = None) -> int:
    """int32 scratch entries per row that :func:`launch_topk` needs. ``programs``: the split factor that
    will be used (1: the "row" path); else the plan of ``batch`` rows; neither: enough for any batch."""
    K = min(k, T)
    if K == T:
        return 0
    if programs is None and batch is not None:
        plan = plan_for(batch, T, K, interpreter=interpreter)
        programs = {"sort": 0, "row": 1}.get(plan.path, plan.programs)
        if programs == 0:
            return 0
    if programs is None:
        programs = SPLIT["interpreter" if interpreter else "gpu"]["max_split"]
    if programs <= 1:
        return sum(_k_cap(K, interpreter, cap))
    return _split_layout(T, K, _spans(T, programs)[1], interpreter, cap)[3]


def _spans(T: int, programs: int):
    """(span, P): spans of a multiple of 16 entries, no empty span."""
    span = triton.cdiv(triton.cdiv(T, programs), 16) * 16
    return span, triton.cdiv(T, span)


def tile_maxima_offset() -> int:
    """Column of the split workspace where the indexer writes its per-tile maxima (``tile_maxima=True``)."""
    return _HDR


def _num_sms(device) -> int:
    import torch

    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def resolve_plan(B: int, T: int, K: int, device=None, *, interpreter: bool = False, programs: int | None = None,
                 path: str | None = None, fin: int | None = None, bins: int | None = None,
                 num_warps: int | None = None) -> Plan:
    """:func:`plan_for` with explicit overrides (``programs=1``: "row"; ``programs >= 2``: "split")."""
    plan = plan_for(B, T, K, interpreter=interpreter, num_sms=DEFAULT_SMS if interpreter else _num_sms(device))
    if K >= T:
        return plan._replace(warps=num_warps or plan.warps)
    if programs is not None:
        plan = plan._replace(path="row" if programs <= 1 else "split", programs=programs)
    if path is not None:
        plan = plan._replace(path=path)
        if path == "split" and plan.programs < 2:
            plan = plan._replace(programs=max(2, min(SPLIT["interpreter" if interpreter else "gpu"]["max_split"],
                                                     T // 16)))
    if fin is not None:
        plan = plan._replace(fin=fin)
    if bins is not None:
        plan = plan._replace(bins=bins)
    if not 0 <= plan.fin <= FIN_MAX:
        raise ValueError(f"fin: expected 0..{FIN_MAX}, got {plan.fin}")
    if num_warps is not None:
        plan = plan._replace(warps=num_warps)
    if plan.bins not in (128, 256):
        raise ValueError(f"bins: expected 128 or 256, got {plan.bins}")
    return plan


def launch_topk(scores, out, scratch=None, *, interpreter: bool = False, cap: int | None = None,
                chunk: int | None = None, num_warps: int | None = None, programs: int | None = None,
                path: str | None = None, fin: int | None = None, bins: int | None = None,
                tile_maxima: bool = False):
    """scores: (B, T) float32 contiguous; out: (B, K) int32 contiguous, K = min(k, T) <= T.

    scratch: (B, >= workspace_entries(T, K, programs=P)) int32, ZERO-initialised before its first use (the
    split path's arrival counters; every call leaves them at zero again). Allocated here (zeros) when None.
    The path and its knobs come from :func:`plan_for` (table ``PLAN``); ``programs`` / ``path`` / ``fin`` /
    ``bins`` / ``num_warps`` override them (``programs=1``: the v1 "row" kernel). ``cap`` / ``chunk``
    override the tile configuration (tests force the fallback paths with a small ``cap``; it is raised to
    K_P2 = next power of two of K, >= 16). ``tile_maxima``: the indexer kernel of this call wrote its
    per-tile maxima at ``scratch[:, tile_maxima_offset():]`` (the split path then skips S1; other paths
    ignore them). Returns ``out``.
    """
    import torch

    B, T = scores.shape
    K = out.shape[1]
    if B == 0 or K == 0:
        return out
    mode = "interpreter" if interpreter else "gpu"
    cfg = CONFIG[mode]
    k_p2, cap = _k_cap(K, interpreter, cap)
    plan = resolve_plan(B, T, K, scores.device, interpreter=interpreter, programs=programs, path=path, fin=fin,
                        bins=bins, num_warps=num_warps)
    pdl = pdl_enabled(scores)
    if plan.path == "sort":
        sort_n = max(16, triton.next_power_of_2(T))
        _topk_kernel[(B,)](scores, out, out, T, 0, K, K_P2=16, CAP=16, CHUNK=16, SORT_N=sort_n,
                           num_warps=plan.warps or cfg["num_warps"], PDL=pdl, launch_pdl=pdl)
        return out
    fin_n = plan.fin * k_p2
    if plan.path == "row":
        need = k_p2 + cap
    else:
        span, P = _spans(T, plan.programs)
        mreg, uoff, umax, need = _split_layout(T, K, P, interpreter, cap)
    if scratch is None:
        scratch = torch.zeros((B, need), dtype=torch.int32, device=scores.device)
    elif (scratch.dtype != torch.int32 or scratch.dim() != 2 or scratch.shape[0] < B
          or not scratch.is_contiguous() or scratch.shape[1] < need):
        raise ValueError(f"scratch: expected a contiguous int32 (B={B}, >= {need}) tensor, "
                         f"got {scratch.dtype} {tuple(scratch.shape)}")
    if plan.path == "row":
        chunk = min(chunk or cfg["chunk"], max(16, triton.next_power_of_2(T)))
        _topk_kernel[(B,)](scores, out, scratch, T, scratch.shape[1], K, K_P2=k_p2, CAP=cap, CHUNK=chunk,
                           SORT_N=0, NB=plan.bins, FIN=fin_n, num_warps=plan.warps or cfg["num_warps"],
                           PDL=pdl, launch_pdl=pdl)
        return out
    scfg = SPLIT[mode]
    schunk = chunk or scfg["chunk"]
    row_chunk = cfg["chunk"]
    nw = plan.warps or split_warps(K, interpreter=interpreter)
    grid = (B, P)
    stride = scratch.shape[1]
    if tile_maxima:
        nmax = triton.cdiv(T, _tile_block(interpreter))
    else:
        nmax = P
        _split_max_kernel[grid](scores, scratch, T, stride, span, CHUNK=schunk, num_warps=nw, PDL=pdl,
                                launch_pdl=pdl)
    ucap = fin_n if fin_n > 0 else -1  # mode 0 (rank finish) needs U <= ucap
    _split_hist_kernel[grid](scores, out, scratch, T, stride, span, P, nmax, mreg, K, ucap, K_P2=k_p2, CAP=cap,
                             CHUNK=schunk, ROW_CHUNK=row_chunk, NB=plan.bins, MCH=256 if not interpreter else 16,
                             PCH=scfg["pch"], PV=scfg["pv"], num_warps=nw, PDL=pdl, launch_pdl=pdl)
    _split_select_kernel[grid](scores, out, scratch, T, stride, span, P, mreg, K, uoff, umax, K_P2=k_p2, CAP=cap,
                               CHUNK=schunk, NB=plan.bins, num_warps=nw, PDL=pdl, launch_pdl=pdl)
    if ucap > 0:
        rk = RANK[mode]
        _split_rank_kernel[(B, triton.cdiv(max(ucap, K), rk["rch"]))](
            out, scratch, T, K, stride, uoff, umax, RCH=rk["rch"], UT=rk["ut"], num_warps=rk["num_warps"], PDL=pdl,
            launch_pdl=pdl)
    return out
