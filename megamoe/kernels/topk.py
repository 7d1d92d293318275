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
def _compact(src, sel_ptr, cand_ptr, T, begin, end, ref, bstar, lo, hi, n_sel, n_cand,
             CAP: tl.constexpr, CHUNK: tl.constexpr):
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
    return n_sel, n_cand


@triton.jit
def _finish(src, dst, sel_ptr, cand_ptr, T, n_sel, n_cand, need,
            K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr):
    """D + E: exact threshold among the (<= CAP, index-ordered) candidates, the ``need`` best appended to
    the ``n_sel`` sure entries; the K selected sorted and stored (-1 for -inf)."""
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

    offs = tl.arange(0, K_P2)
    sidx = tl.load(sel_ptr + offs, mask=offs < K, other=0, cache_modifier=".cg")
    p = _pack(_load_keys(src, sidx, T), sidx, T)
    p = tl.sort(tl.where(offs < K, p, -9223372036854775807 - 1), descending=True)
    _store_sorted(dst, p, T, K, K_P2)


@triton.jit
def _store_sorted(dst, p, T, K: tl.constexpr, K_P2: tl.constexpr):
    offs = tl.arange(0, K_P2)
    key = (p >> 32).to(tl.int32)
    index = T - 1 - p.to(tl.int32)
    tl.store(dst + offs, tl.where(key == -2139095041, -1, index), mask=offs < K)


@triton.jit
def _row_topk(src, dst, sel_ptr, cand_ptr, T,
              K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """The whole v1 selection of one row by one program (K < T)."""
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
    zero = tl.zeros([], tl.int32)
    n_sel, n_cand = _compact(src, sel_ptr, cand_ptr, T, 0, T, ref, bstar, lo, hi, zero, zero, CAP, CHUNK)
    tl.debug_barrier()
    # ---- D + E
    _finish(src, dst, sel_ptr, cand_ptr, T, n_sel, n_cand, need, K, K_P2, CAP)


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, scratch_ptr, T, scratch_stride,
                 K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                 ALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = scores_ptr + row * T
    dst = out_ptr + row * K
    if ALL:  # K == T: every entry, sorted
        offs = tl.arange(0, K_P2)
        p = _pack(_load_keys(src, offs, T), offs, T)
        p = tl.sort(tl.where(offs < T, p, -9223372036854775807 - 1), descending=True)
        _store_sorted(dst, p, T, K, K_P2)
    else:
        sel_ptr = scratch_ptr + row * scratch_stride  # K_P2 int32 indices of the selected entries
        cand_ptr = sel_ptr + K_P2                     # CAP int32 indices of the candidates
        _row_topk(src, dst, sel_ptr, cand_ptr, T, K, K_P2, CAP, CHUNK)


# ---------------------------------------------------------------- v2: rows split over P programs
# Per-row int32 workspace of the split path (offsets from the row's base):
#   [0] arrival counter (0 between calls), [1] b*, [2] need, [3] fallback flag,
#   [16 + p] span maxima (P_P2), then P_P2 x 128 span histograms, then P_P2 sure offsets, P_P2 candidate
#   offsets, then sel (K_P2) and cand (CAP) as in v1.
_HDR = 16


@triton.jit
def _span_bounds(p, T, SPAN):
    begin = p * SPAN
    return begin, tl.minimum(begin + SPAN, T)


@triton.jit
def _split_max_kernel(scores_ptr, ws_ptr, T, ws_stride, SPAN, P: tl.constexpr, CHUNK: tl.constexpr):
    """S1, grid (B, P): the maximum key of each program's span of the row."""
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
def _split_hist_kernel(scores_ptr, out_ptr, ws_ptr, T, ws_stride, SPAN,
                       K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                       P: tl.constexpr, P_P2: tl.constexpr, ROW_CHUNK: tl.constexpr):
    """S2, grid (B, P): 128-bin histogram of each span below the exact row maximum; the last program of
    the row to arrive merges them in program order: b*, need, and per-program output offsets (sure entries
    and candidates, so S3 writes them in index order). More than CAP candidates in b* (dense ties, not
    the -inf bucket): that program runs the whole v1 selection of the row and flags it done."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    src = scores_ptr + row * T
    ws = ws_ptr + row * ws_stride
    pp = tl.arange(0, P_P2)
    ref = tl.max(tl.load(ws + 16 + pp, mask=pp < P, other=-2147483648), 0)
    begin, end = _span_bounds(p, T, SPAN)
    lane = tl.arange(0, CHUNK)
    h = tl.zeros([128], tl.int32)
    start = begin
    while start < end:
        idx = start + lane
        live = idx < end
        o = _load_keys(src, idx, T)
        h += tl.histogram(tl.where(live, _bucket(o, ref), 0), 128, mask=live)
        start += CHUNK
    hist = ws + 16 + P_P2  # (P, 128)
    bins = tl.arange(0, 128)
    tl.store(hist + p * 128 + bins, h)
    tl.debug_barrier()
    arrived = tl.atomic_add(ws, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:
        tl.debug_barrier()
        hp = tl.load(hist + pp[:, None] * 128 + bins[None, :], mask=(pp < P)[:, None], other=0,
                     cache_modifier=".cg")
        bstar, before, count = _find_bucket(tl.sum(hp, 0), K, 128)
        need = K - before
        sure_p = tl.sum(tl.where(bins[None, :] < bstar, hp, 0), 1)
        cand_p = tl.sum(tl.where(bins[None, :] == bstar, hp, 0), 1)
        offs_ptr = hist + P_P2 * 128
        tl.store(offs_ptr + pp, tl.cumsum(sure_p, 0) - sure_p)
        tl.store(offs_ptr + P_P2 + pp, tl.cumsum(cand_p, 0) - cand_p)
        fallback = (count > CAP) & (bstar != 126)
        tl.store(ws + 1, bstar)
        tl.store(ws + 2, need)
        tl.store(ws + 3, fallback.to(tl.int32))
        tl.store(ws, 0)  # counter back to 0 for S3 and the next call
        if fallback:
            sel_ptr = offs_ptr + 2 * P_P2
            _row_topk(src, out_ptr + row * K, sel_ptr, sel_ptr + K_P2, T, K, K_P2, CAP, ROW_CHUNK)


@triton.jit
def _split_select_kernel(scores_ptr, out_ptr, ws_ptr, T, ws_stride, SPAN,
                         K: tl.constexpr, K_P2: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                         P: tl.constexpr, P_P2: tl.constexpr):
    """S3, grid (B, P): each span appends its sure entries and candidates at the offsets of S2 (index
    order, as v1); the last program of the row to arrive finds the exact threshold and sorts (v1 D + E)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    src = scores_ptr + row * T
    ws = ws_ptr + row * ws_stride
    if tl.load(ws + 3) == 0:
        pp = tl.arange(0, P_P2)
        ref = tl.max(tl.load(ws + 16 + pp, mask=pp < P, other=-2147483648), 0)
        bstar = tl.load(ws + 1)
        need = tl.load(ws + 2)
        offs_ptr = ws + 16 + P_P2 + P_P2 * 128
        sel_ptr = offs_ptr + 2 * P_P2
        cand_ptr = sel_ptr + K_P2
        begin, end = _span_bounds(p, T, SPAN)
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        _compact(src, sel_ptr, cand_ptr, T, begin, end, ref, bstar, lo, hi,
                 tl.load(offs_ptr + p), tl.load(offs_ptr + P_P2 + p), CAP, CHUNK)
        tl.debug_barrier()
        arrived = tl.atomic_add(ws, 1, sem="acq_rel", scope="gpu")
        if arrived == P - 1:
            tl.debug_barrier()
            tl.store(ws, 0)
            # candidates in b* = exclusive offset of the last span + its own count (from its histogram)
            n_cand = tl.load(offs_ptr + P_P2 + P - 1, cache_modifier=".cg")
            last_h = tl.load(ws + 16 + P_P2 + (P - 1) * 128 + bstar, cache_modifier=".cg")
            _finish(src, out_ptr + row * K, sel_ptr, cand_ptr, T, K - need, n_cand + last_h, need, K, K_P2, CAP)


#: Split path (v2): at most MAX_SPLIT programs per row, each span >= MIN_SPAN entries; rows are split when
#: the batch leaves SMs idle (DEFAULT_SMS when no CUDA device is visible).
SPLIT = {"gpu": dict(min_span=512, max_split=64, chunk=1024, num_warps=16),
         "interpreter": dict(min_span=64, max_split=8, chunk=64, num_warps=4)}
DEFAULT_SMS = 132


def split_programs(B: int, T: int, k: int, *, interpreter: bool = False, num_sms: int = DEFAULT_SMS) -> int:
    """Programs per row (host choice from shapes only): 1 (the v1 kernel) unless K < T and the batch leaves
    SMs idle; then min(MAX_SPLIT, num_sms // B, T // MIN_SPAN) programs."""
    cfg = SPLIT["interpreter" if interpreter else "gpu"]
    if min(k, T) >= T or B <= 0:
        return 1
    p = min(cfg["max_split"], num_sms // B, T // cfg["min_span"])
    return p if p >= 2 else 1


def workspace_entries(T: int, k: int, *, interpreter: bool = False, programs: int | None = None) -> int:
    """int32 scratch entries per row that :func:`launch_topk` needs (0 when ``k >= T``). ``programs``:
    the split factor that will be used (default: the largest possible one, so any batch size fits)."""
    K = min(k, T)
    if K == T:
        return 0
    k_p2 = max(16, triton.next_power_of_2(K))
    cap = max(CONFIG["interpreter" if interpreter else "gpu"]["cap"], k_p2)
    if programs is None:
        programs = SPLIT["interpreter" if interpreter else "gpu"]["max_split"]
    if programs <= 1:
        return k_p2 + cap
    return _HDR + triton.next_power_of_2(programs) * 131 + k_p2 + cap


def _num_sms(device) -> int:
    import torch

    if getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def launch_topk(scores, out, scratch=None, *, interpreter: bool = False, cap: int | None = None,
                chunk: int | None = None, num_warps: int | None = None, programs: int | None = None):
    """scores: (B, T) float32 contiguous; out: (B, K) int32 contiguous, K = min(k, T) <= T.

    scratch: (B, >= workspace_entries(T, K, programs=P)) int32, ZERO-initialised before its first use (the
    split path's arrival counters; every call leaves them at zero again). Allocated here (zeros) when None.
    ``programs``: programs per row (default :func:`split_programs` from B, T and the SM count; 1 = the v1
    one-program-per-row kernel). ``cap`` / ``chunk`` / ``num_warps`` override the tile configuration (tests
    force the fallback paths with a small ``cap``; it is raised to K_P2 = next power of two of K, >= 16).
    """
    import torch

    B, T = scores.shape
    K = out.shape[1]
    if B == 0 or K == 0:
        return out
    mode = "interpreter" if interpreter else "gpu"
    cfg = CONFIG[mode]
    k_p2 = max(16, triton.next_power_of_2(K))
    all_entries = K == T
    cap = max(triton.next_power_of_2(cap or cfg["cap"]), k_p2)
    if programs is None:
        programs = split_programs(B, T, K, interpreter=interpreter,
                                  num_sms=DEFAULT_SMS if interpreter else _num_sms(scores.device))
    span = triton.cdiv(triton.cdiv(T, max(1, programs)), 16) * 16
    programs = 1 if all_entries else triton.cdiv(T, span)  # no empty spans
    if all_entries:
        scratch = out  # unused
    else:
        need = k_p2 + cap if programs == 1 else _HDR + triton.next_power_of_2(programs) * 131 + k_p2 + cap
        if scratch is None:
            scratch = torch.zeros((B, need), dtype=torch.int32, device=scores.device)
        elif (scratch.dtype != torch.int32 or scratch.dim() != 2 or scratch.shape[0] < B
              or not scratch.is_contiguous() or scratch.shape[1] < need):
            raise ValueError(f"scratch: expected a contiguous int32 (B={B}, >= {need}) tensor, "
                             f"got {scratch.dtype} {tuple(scratch.shape)}")
    if programs == 1:
        chunk = min(chunk or cfg["chunk"], max(16, triton.next_power_of_2(T)))
        _topk_kernel[(B,)](scores, out, scratch, T, 0 if all_entries else scratch.shape[1],
                           K=K, K_P2=k_p2, CAP=cap, CHUNK=chunk, ALL=all_entries,
                           num_warps=num_warps or cfg["num_warps"])
        return out
    scfg = SPLIT[mode]
    p_p2 = triton.next_power_of_2(programs)
    schunk = min(chunk or scfg["chunk"], triton.next_power_of_2(span))
    row_chunk = min(cfg["chunk"], max(16, triton.next_power_of_2(T)))
    nw = num_warps or scfg["num_warps"]
    grid = (B, programs)
    stride = scratch.shape[1]
    _split_max_kernel[grid](scores, scratch, T, stride, span, P=programs, CHUNK=schunk, num_warps=nw)
    _split_hist_kernel[grid](scores, out, scratch, T, stride, span, K=K, K_P2=k_p2, CAP=cap, CHUNK=schunk,
                             P=programs, P_P2=p_p2, ROW_CHUNK=row_chunk, num_warps=nw)
    _split_select_kernel[grid](scores, out, scratch, T, stride, span, K=K, K_P2=k_p2, CAP=cap, CHUNK=schunk,
                               P=programs, P_P2=p_p2, num_warps=nw)
    return out
