"""Exact top-k indices of float32 score rows (the V4 indexer's selection): a bucket select, one program per row.

Output (bit for bit ``megamoe.reference.kvcache.select_topk``): the ``K = min(k, T)`` entries with the largest
scores, best first, ties to the lower index, ``-0.0 == +0.0``, NaN above ``+inf`` (after ``x + 0.0``, as the
reference), ``-1`` where the selected score is ``-inf``.

Each score becomes the reference's order-preserving int32 key ``o`` (``bits ^ 0x7FFFFFFF`` for negative bits)
and each entry the unique int64 ``(o << 32) | (T - 1 - index)``: larger is better, so the answer is the K
largest of these, sorted descending. Per row (one program; the row streams through L1 in CHUNKs):

A+B. one pass: the row maximum key and a 128-bin histogram of ``_bucket(o, ref)`` (log-linear below
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
D. registers: the candidates' keys are re-gathered; 64-bin linear histograms find the exact threshold key;
   candidates above it and the ``need`` lowest-index ones equal to it are appended to ``sel``.
E. the K selected entries are gathered, packed to int64, sorted descending (bitonic ``tl.sort``), decoded.

Row loops are while loops (the interpreter cannot range() over a runtime int). Everything after the launch
is data-dependent control flow inside the program (no host sync); host choices depend on shapes only.
``K == T`` skips A-D (all entries, sorted). Scratch is global memory written and re-read by the same program
after a CTA barrier (the re-reads use ``.cg``: L2, never a stale L1 line).
"""
import triton
import triton.language as tl

#: Tile configuration (GPU, interpreter): CHUNK entries per streamed tile, CAP candidate slots (>= K_P2),
#: warps per program.
CONFIG = {"gpu": dict(chunk=4096, cap=2048, num_warps=16), "interpreter": dict(chunk=256, cap=512, num_warps=4)}

#: The order-preserving int32 key of -inf (``0xFF800000 ^ 0x7FFFFFFF`` as int32; literal in the kernels).
NEG_INF_KEY = -2139095041


@triton.jit
def _ordered(x):
    """float32 -> order-preserving int32 (the reference's map; ``+ 0.0`` makes -0.0 equal +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _bucket(o, ref):
    """Bucket in [0, 127] of key ``o`` (int32), non-increasing in ``o``: 0 for ``o > ref - 256``,
    1..125 log-linear in ``d = (ref - o) >> 8`` (4 buckets per octave; d < 2**24 converts to float32
    exactly), 126 for -inf, 127 below -inf (negative-signed NaN, CPU only)."""
    d = ((ref - o).to(tl.uint32, bitcast=True) >> 8).to(tl.int32)  # ref >= o: the wrapped difference
    b = (d.to(tl.float32).to(tl.int32, bitcast=True) >> 21) - 507  # d = 1 -> 508 - 507 = bucket 1
    b = tl.minimum(tl.maximum(b, 0), 125)
    b = tl.where(o > ref, 0, b)
    b = tl.where(o == -2139095041, 126, b)
    return tl.where(o < -2139095041, 127, b)


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
def _row_histogram(src, T, ref, CHUNK: tl.constexpr):
    """Bucket histogram of a row (padding counted in bucket 127 and removed) and its maximum key."""
    lane = tl.arange(0, CHUNK)
    h = tl.zeros([128], tl.int32)
    mx = tl.full([CHUNK], -2147483648, tl.int32)
    start = 0
    while start < T:
        idx = start + lane
        live = idx < T
        o = _load_keys(src, idx, T)
        mx = tl.maximum(mx, tl.where(live, o, -2147483648))
        h += tl.histogram(tl.where(live, _bucket(o, ref), 127), 128)
        start += CHUNK
    pad = tl.cdiv(T, CHUNK) * CHUNK - T
    h -= tl.where(tl.arange(0, 128) == 127, pad, 0)
    return h, tl.max(mx, 0)


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, scratch_ptr, T, scratch_stride,
                 K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                 ALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * T
    dst = out_ptr + row * K
    offs = tl.arange(0, K_P2)

    if ALL:  # K == T: every entry, sorted
        p = _pack(_load_keys(src, offs, T), offs, T)
        p = tl.sort(tl.where(offs < T, p, -9223372036854775807 - 1), descending=True)
    else:
        sel_ptr = scratch_ptr + row * scratch_stride  # K_P2 int32 indices of the selected entries
        cand_ptr = sel_ptr + K_P2                     # CAP int32 indices of the candidates
        lane = tl.arange(0, CHUNK)

        # ---- A+B: histogram of buckets below the first chunk's maximum (and the row maximum)
        o0 = _load_keys(src, lane, T)
        ref = tl.max(tl.where(lane < T, o0, -2147483648), 0)
        h, m = _row_histogram(src, T, ref, CHUNK)
        bstar, before, count = _find_bucket(h, K, 128)
        if bstar == 0:
            # more than K entries near or above the first chunk's maximum: rebuild below the row maximum
            ref = m
            h, m = _row_histogram(src, T, ref, CHUNK)
            bstar, before, count = _find_bucket(h, K, 128)
        need = K - before
        # candidates: bucket b* and key in [lo, hi]; everything better is selected
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        if bstar == 126:
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
                member = (idx < T) & (_bucket(o, ref) == bstar)
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
                    member = (idx < T) & (_bucket(o, ref) == bstar) & (o >= lo.to(tl.int32)) & (o <= hi.to(tl.int32))
                    hl += tl.histogram(tl.where(member, _distance(o, hi, s), 0), 64, mask=member)
                    start += CHUNK
                lo, hi, need, count = _narrow(hl, lo, hi, s, need)

        # ---- C: append the indices of sure entries to sel, of candidates (first CAP) to cand, in order
        lo32 = lo.to(tl.int32)
        hi32 = hi.to(tl.int32)
        n_sel = tl.zeros([], tl.int32)
        n_cand = tl.zeros([], tl.int32)
        start = 0
        while start < T:
            idx = start + lane
            live = idx < T
            o = _load_keys(src, idx, T)
            bkt = _bucket(o, ref)
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
        tl.debug_barrier()

        # ---- D: exact threshold among the candidates (registers)
        coffs = tl.arange(0, CAP)
        valid = coffs < tl.minimum(n_cand, CAP)
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

        # ---- E: sort the K selected entries
        sidx = tl.load(sel_ptr + offs, mask=offs < K, other=0, cache_modifier=".cg")
        p = _pack(_load_keys(src, sidx, T), sidx, T)
        p = tl.sort(tl.where(offs < K, p, -9223372036854775807 - 1), descending=True)

    key = (p >> 32).to(tl.int32)
    index = T - 1 - p.to(tl.int32)
    tl.store(dst + offs, tl.where(key == -2139095041, -1, index), mask=offs < K)


def workspace_entries(T: int, k: int, *, interpreter: bool = False) -> int:
    """int32 scratch entries per row that :func:`launch_topk` needs (0 when ``k >= T``)."""
    K = min(k, T)
    if K == T:
        return 0
    k_p2 = max(16, triton.next_power_of_2(K))
    cap = max(CONFIG["interpreter" if interpreter else "gpu"]["cap"], k_p2)
    return k_p2 + cap


def launch_topk(scores, out, scratch=None, *, interpreter: bool = False, cap: int | None = None,
                chunk: int | None = None, num_warps: int | None = None):
    """scores: (B, T) float32 contiguous; out: (B, K) int32 contiguous, K = min(k, T) <= T.

    scratch: (B, >= K_P2 + CAP) int32 (allocated here when None; see :func:`workspace_entries`).
    ``cap`` / ``chunk`` / ``num_warps`` override the tile configuration (tests force the fallback paths
    with a small ``cap``; it is raised to K_P2 = next power of two of K, at least 16).
    """
    import torch

    B, T = scores.shape
    K = out.shape[1]
    if B == 0 or K == 0:
        return out
    cfg = CONFIG["interpreter" if interpreter else "gpu"]
    k_p2 = max(16, triton.next_power_of_2(K))
    all_entries = K == T
    cap = max(triton.next_power_of_2(cap or cfg["cap"]), k_p2)
    chunk = min(chunk or cfg["chunk"], max(16, triton.next_power_of_2(T)))
    if all_entries:
        scratch = out  # unused
    elif scratch is None:
        scratch = torch.empty((B, k_p2 + cap), dtype=torch.int32, device=scores.device)
    elif (scratch.dtype != torch.int32 or scratch.dim() != 2 or scratch.shape[0] < B
          or not scratch.is_contiguous() or scratch.shape[1] < k_p2 + cap):
        raise ValueError(f"scratch: expected a contiguous int32 (B={B}, >= {k_p2 + cap}) tensor, "
                         f"got {scratch.dtype} {tuple(scratch.shape)}")
    _topk_kernel[(B,)](scores, out, scratch, T, 0 if all_entries else scratch.shape[1],
                       K=K, K_P2=k_p2, CAP=cap, CHUNK=chunk, ALL=all_entries, num_warps=num_warps or cfg["num_warps"])
    return out
