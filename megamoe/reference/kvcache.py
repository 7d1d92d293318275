"""Pure-PyTorch references of the compressed-cache steps (exact semantics the kernels reproduce).

Shapes: B rows of a decode batch; row ``b`` is request slot ``slots[b]`` at token position
``positions[b]`` (the position of the token this step appends) and takes part when ``active[b]``.
Entry index of the token at ``pos`` is ``pos // m``; a row *flushes* when it is active and
``(pos + 1) % m == 0``. Policies (zero/NaN entries, numerics, top-k tie-break, out-of-range indices) are
in ``megamoe/kvcache/config.py``: a row whose slot is outside ``[0, S)`` or whose position is negative is
a no-op, a page id outside ``[0, num_pages)`` is treated as unallocated (reads give zeros / ``-inf``).
"""
from __future__ import annotations

import torch

from ..format.e2m1 import e2m1_decode, pack_nibbles, unpack_nibbles
from ..format.tensor import NVFP4Tensor
from ..kvcache.config import ENTRY_SCALE_BLOCK, FP8_MAX, INDEX_KEY_GLOBAL_SCALE, INDEX_SCALE_BLOCK
from ..kvcache.state import CompressorState, PagedPool
from .quantize import dequantize, quantize
from .v4_numerics import apply_rope, fp4_block_encode, fp8_block_encode, hadamard_rotate, rms_norm


# ----------------------------------------------------------------------------------------------
# entry / key quantization
# ----------------------------------------------------------------------------------------------
def _finite_blocks(x: torch.Tensor, block: int):
    """(N, D) float32 -> (blocks (N, D // block, block) with non-finite blocks zeroed, finite (N, D // block))."""
    g = x.unflatten(-1, (-1, block))
    finite = torch.isfinite(g).all(dim=-1)
    return torch.where(finite[..., None], g, torch.zeros((), device=x.device)), finite


def quantize_entries(entry: torch.Tensor, rope_dim: int, numerics: str = "official"):
    """entry: (N, D) bf16 -> (fp8 (N, D - rope_dim) float8_e4m3fn, scale (N, cols) float32, rope (N, rope_dim) bf16).

    official (cols = nope // 64): per 64-dim block the official ``act_quant``: ``scale = pow2ceil(max(amax,
    1e-4) / 448)``, FP8 = e4m3_rne(clamp(x / scale, +-448)); a block with NaN/Inf: scale NaN, bytes 0.
    per_entry (cols = 1): ``scale = amax / 448`` over the non-RoPE dims; all-zero entry: scale 0, x divided
    by 1 (signed zeros); any non-finite element: scale NaN, FP8 bytes 0.
    """
    x = entry.float()
    nope = x[:, : x.shape[1] - rope_dim]
    rope = entry[:, x.shape[1] - rope_dim:].to(torch.bfloat16)
    zero_byte = torch.zeros((), dtype=torch.uint8, device=x.device)
    nan = torch.full((), float("nan"), device=x.device)
    if numerics == "official":
        blocks, finite = _finite_blocks(nope, ENTRY_SCALE_BLOCK)
        codes, scale = fp8_block_encode(blocks.flatten(-2), ENTRY_SCALE_BLOCK)
        keep = finite.repeat_interleave(ENTRY_SCALE_BLOCK, dim=-1)
        q_bytes = torch.where(keep, codes.view(torch.uint8), zero_byte)
        return q_bytes.view(torch.float8_e4m3fn), torch.where(finite, scale, nan), rope
    if numerics != "per_entry":
        raise ValueError(f"numerics: expected 'official' or 'per_entry', got {numerics!r}")
    finite = torch.isfinite(nope).all(dim=1)
    amax = torch.where(torch.isfinite(nope), nope.abs(), torch.zeros((), device=x.device)).amax(dim=1)
    scale = amax / FP8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones((), device=x.device))
    q = torch.clamp(nope / divisor[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q_bytes = torch.where(finite[:, None], q.view(torch.uint8), zero_byte)
    scale = torch.where(finite, scale, nan)
    return q_bytes.view(torch.float8_e4m3fn), scale[:, None], rope


def dequantize_entries(fp8: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """(..., nope) fp8, (..., cols) float32, (..., rope) bf16 -> (..., nope + rope) bf16.

    Dim ``j`` of the non-RoPE part is ``bf16(float(fp8[j]) * scale[j // (nope // cols)])``; RoPE dims as is.
    """
    cols = scale.shape[-1]
    nope = (fp8.float().unflatten(-1, (cols, -1)) * scale[..., None]).flatten(-2).to(torch.bfloat16)
    return torch.cat([nope, rope.to(torch.bfloat16)], dim=-1)


def quantize_index_keys(key: torch.Tensor, numerics: str = "official"):
    """key: (N, Di) bf16 -> (data (N, Di // 2) uint8 packed E2M1, low nibble = even element; scale).

    official: the official ``fp4_act_quant(key, 32)`` (power-of-two scale ``pow2ceil(max(amax, 6 * 2**-126)
    / 6)`` per 32 dims), scale stored as an E8M0 byte ``(N, Di // 32) uint8`` = the scale's float32 biased
    exponent; a block with NaN/Inf: byte 0xFF, codes 0.
    nvfp4: NVFP4 of ``megamoe.reference.quantize.quantize`` with the fixed global scale 1.0; scale
    ``(N, Di // 16) float8_e4m3fn``.
    """
    if numerics == "official":
        blocks, finite = _finite_blocks(key.float(), INDEX_SCALE_BLOCK)
        codes, scale = fp4_block_encode(blocks.flatten(-2), INDEX_SCALE_BLOCK)
        codes = torch.where(finite.repeat_interleave(INDEX_SCALE_BLOCK, dim=-1), codes,
                            torch.zeros((), dtype=torch.uint8, device=key.device))
        exponent = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        exponent = torch.where(finite, exponent, torch.full((), 0xFF, dtype=torch.uint8, device=key.device))
        return pack_nibbles(codes), exponent
    if numerics != "nvfp4":
        raise ValueError(f"numerics: expected 'official' or 'nvfp4', got {numerics!r}")
    gs = torch.full((), INDEX_KEY_GLOBAL_SCALE, dtype=torch.float32, device=key.device)
    t = quantize(key.float(), global_scale=gs)
    return t.data, t.block_scale


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> float32 ``2 ** (byte - 127)``; 0xFF -> NaN (byte 0, 2**-127, is never written)."""
    value = (byte.to(torch.int32) << 23).view(torch.float32)
    return torch.where(byte == 0xFF, torch.full((), float("nan"), device=byte.device), value)


def dequantize_index_keys(data: torch.Tensor, block_scale: torch.Tensor, numerics: str = "official") -> torch.Tensor:
    """(..., Di // 2) uint8 + scales (see :func:`quantize_index_keys`) -> (..., Di) float32 (exact)."""
    if numerics == "official":
        values = e2m1_decode(unpack_nibbles(data)).unflatten(-1, (block_scale.shape[-1], -1))
        return (values * e8m0_to_float(block_scale)[..., None]).flatten(-2)
    shape = tuple(data.shape[:-1]) + (data.shape[-1] * 2,)
    gs = torch.full((), INDEX_KEY_GLOBAL_SCALE, dtype=torch.float32, device=data.device)
    return dequantize(NVFP4Tensor(data, block_scale, gs, shape), torch.float32)


# ----------------------------------------------------------------------------------------------
# post-pool steps and prefill pooling (official ``Compressor.forward``)
# ----------------------------------------------------------------------------------------------
def post_pool(pooled: torch.Tensor, norm_weight: torch.Tensor, freqs: torch.Tensor, eps: float,
              rotate: bool) -> torch.Tensor:
    """Pooled rows (N, D) float32 -> (N, D) bf16 ready to quantize: ``bf16`` -> RMSNorm(norm_weight) ->
    RoPE of the last ``2 * freqs.shape[-1]`` dims with ``freqs`` (N, rope_dim // 2) complex64 (the row's
    window-start position) -> Hadamard rotation when ``rotate`` (indexer keys)."""
    x = rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
    x = apply_rope(x, freqs)
    return hadamard_rotate(x) if rotate else x


def prefill_pool(kv: torch.Tensor, score: torch.Tensor, ratio: int, width: int, overlap: bool,
                 chunk_windows: int | None = None):
    """Official prefill compression of a fresh request's T tokens (positions 0..T-1).

    kv, score: (T, C * D) float32 (score including ape). Returns ``(pooled (T // m, D) float32,
    tail_k (m, C * D), tail_z, tail_kb (m, D) | None, tail_zb | None, tail_len)``: the pooled entries of the
    complete windows (official ``overlap_transform`` + softmax over the 2m (CSA) or m slots) and the
    compressor state the decode continues from (a-stream: the unfinished window's tokens in rows
    ``pos % m``; b-stream: the last complete window's overlap half). ``chunk_windows`` pools that many
    windows at a time (same values: every window's softmax and sum are independent).
    """
    T, cols = kv.shape
    n, m, d = T // ratio, ratio, width
    cutoff = n * m
    pooled = kv.new_empty((n, d))
    step = chunk_windows or max(n, 1)
    for w0 in range(0, n, step):
        w1 = min(n, w0 + step)
        kw = kv[w0 * m:w1 * m].unflatten(0, (w1 - w0, m))
        zw = score[w0 * m:w1 * m].unflatten(0, (w1 - w0, m))
        if overlap:  # official ``overlap_transform``: [previous window's [:d] | this window's [d:]]
            def transform(t, src, fill):
                out = t.new_full((w1 - w0, 2 * m, d), fill)
                out[:, m:] = t[:, :, d:]
                p0 = max(w0, 1)
                out[p0 - w0:, :m] = src[(p0 - 1) * m:(w1 - 1) * m, :d].unflatten(0, (w1 - p0, m))
                return out
            kw, zw = transform(kw, kv, 0.0), transform(zw, score, float("-inf"))
        pooled[w0:w1] = (kw * zw.softmax(dim=1)).sum(dim=1)
    rem = T - cutoff
    tail_k = kv.new_zeros((m, cols))
    tail_z = kv.new_full((m, cols), float("-inf"))
    tail_k[:rem], tail_z[:rem] = kv[cutoff:], score[cutoff:]
    tail_kb = tail_zb = None
    if overlap:
        tail_kb = kv.new_zeros((m, d))
        tail_zb = kv.new_full((m, d), float("-inf"))
        if n:
            tail_kb.copy_(kv[cutoff - m:cutoff, :d])
            tail_zb.copy_(score[cutoff - m:cutoff, :d])
    return pooled, tail_k, tail_z, tail_kb, tail_zb, rem


# ----------------------------------------------------------------------------------------------
# compressor step (append + pool + rotate)
# ----------------------------------------------------------------------------------------------
def compressor_step(state: CompressorState, kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, active: torch.Tensor, pooled_out: torch.Tensor | None = None):
    """Append each active row's token to its slot's a-stream; pool and rotate the rows that flush.

    kv, score: (B, C * D) float32 (C = 2 with overlap: ``[:D]`` overlap half, ``[D:]`` main half).
    slots, positions: (B,) int; active: (B,) bool.
    Returns ``(pooled (B, D) float32, flush (B,) bool)``; pooled rows that do not flush keep
    ``pooled_out``'s old values (zeros when not given). Mutates ``state``.

    Pooled entry = sum_j softmax_j(z) * k over the a-stream main half (m slots) and, with overlap, the
    b-stream (m slots of the previous window's overlap half); per feature, in float32.
    On flush: b <- a[:, :D] (overlap), a <- (k 0, z -inf), tail_len <- 0; otherwise tail_len <- pos % m + 1.
    A row whose slot is outside ``[0, S)`` or whose position is negative is inactive.
    """
    m, d = state.ratio, state.width
    B = kv.shape[0]
    pooled = torch.zeros((B, d), dtype=torch.float32, device=kv.device) if pooled_out is None else pooled_out.clone()
    flush = torch.zeros((B,), dtype=torch.bool, device=kv.device)
    a_off = d if state.overlap else 0
    num_slots = state.tail_len.shape[0]
    for b in range(B):
        s, pos = int(slots[b]), int(positions[b])
        if not bool(active[b]) or not 0 <= s < num_slots or pos < 0:
            continue
        cur = pos % m
        state.tail_k[s, cur] = kv[b].float()
        state.tail_z[s, cur] = score[b].float()
        if (pos + 1) % m:
            state.tail_len[s] = cur + 1
            continue
        flush[b] = True
        k = state.tail_k[s, :, a_off:a_off + d]
        z = state.tail_z[s, :, a_off:a_off + d]
        if state.overlap:
            k = torch.cat([state.tail_kb[s], k], dim=0)
            z = torch.cat([state.tail_zb[s], z], dim=0)
        pooled[b] = (k * torch.softmax(z, dim=0)).sum(dim=0)
        if state.overlap:
            state.tail_kb[s] = state.tail_k[s, :, :d]
            state.tail_zb[s] = state.tail_z[s, :, :d]
        state.tail_k[s] = 0.0
        state.tail_z[s] = float("-inf")
        state.tail_len[s] = 0
    return pooled, flush


# ----------------------------------------------------------------------------------------------
# flush write (quantize + scatter into the paged pool)
# ----------------------------------------------------------------------------------------------
def entry_location(block_table: torch.Tensor, slot: int, entry_index: int, entries_per_block: int,
                   num_pages: int | None = None):
    """(physical page, slot in page) of a request's entry, or None when it has no storage: slot outside
    ``[0, S)``, negative entry, logical page past the table, page -1 or (with ``num_pages``) >= num_pages."""
    if not 0 <= slot < block_table.shape[0] or entry_index < 0:
        return None
    lb = entry_index // entries_per_block
    if lb >= block_table.shape[1]:
        return None
    page = int(block_table[slot, lb])
    if page < 0 or (num_pages is not None and page >= num_pages):
        return None
    return page, entry_index % entries_per_block


def flush_write(pool: PagedPool, block_table: torch.Tensor, entry: torch.Tensor, index_key: torch.Tensor | None,
                flush: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, ratio: int) -> None:
    """Quantize (``pool.entry_numerics`` / ``pool.index_numerics``) and scatter the entries of the rows with
    ``flush[b]`` (no-op for the others).

    entry: (B, head_dim) bf16; index_key: (B, index_head_dim) bf16 or None (HCA).
    Row b goes to entry ``positions[b] // ratio`` of slot ``slots[b]`` via ``block_table (S, L) int32``
    (no storage, see :func:`entry_location`, or a negative position: the row is skipped).
    """
    epb, pages = pool.entries_per_block, pool.entries_fp8.shape[0]
    rope_dim = pool.entries_rope.shape[-1]
    fp8, scale, rope = quantize_entries(entry, rope_dim, pool.entry_numerics)
    if index_key is not None:
        kdata, kscale = quantize_index_keys(index_key, pool.index_numerics)
    for b in range(entry.shape[0]):
        pos = int(positions[b])
        if not bool(flush[b]) or pos < 0:
            continue
        loc = entry_location(block_table, int(slots[b]), pos // ratio, epb, pages)
        if loc is None:
            continue
        p, e = loc
        pool.entries_fp8[p, e] = fp8[b]
        pool.entries_scale[p, e] = scale[b]
        pool.entries_rope[p, e] = rope[b]
        if index_key is not None:
            pool.index_keys[p, e] = kdata[b]
            pool.index_key_scale[p, e] = kscale[b]


# ----------------------------------------------------------------------------------------------
# readers
# ----------------------------------------------------------------------------------------------
def gather_entries(pool: PagedPool, block_table: torch.Tensor, slots: torch.Tensor,
                   indices: torch.Tensor) -> torch.Tensor:
    """Dequantize selected entries: indices (B, K) int (-1 = none) -> (B, K, head_dim) bf16 (zeros for -1 and
    for entries without storage, see :func:`entry_location`)."""
    B, K = indices.shape
    epb, pages = pool.entries_per_block, pool.entries_fp8.shape[0]
    d = pool.entries_fp8.shape[-1] + pool.entries_rope.shape[-1]
    out = torch.zeros((B, K, d), dtype=torch.bfloat16, device=indices.device)
    for b in range(B):
        for j in range(K):
            t = int(indices[b, j])
            loc = None if t < 0 else entry_location(block_table, int(slots[b]), t, epb, pages)
            if loc is None:
                continue
            p, e = loc
            out[b, j] = dequantize_entries(pool.entries_fp8[p, e], pool.entries_scale[p, e], pool.entries_rope[p, e])
    return out


def request_index_keys(pool: PagedPool, block_table: torch.Tensor, slot: int, count: int):
    """A request's first ``count`` indexer keys decoded to float32 ``(count, Di)`` and a ``(count,)`` bool
    mask of the entries that have storage (see :func:`entry_location`; others: zero keys)."""
    dev = pool.index_keys.device
    epb, pages = pool.entries_per_block, pool.index_keys.shape[0]
    di = pool.index_keys.shape[-1] * 2
    if not 0 <= slot < block_table.shape[0]:
        return (torch.zeros((count, di), dtype=torch.float32, device=dev),
                torch.zeros((count,), dtype=torch.bool, device=dev))
    t = torch.arange(count, device=dev)
    lb = t // epb
    in_table = lb < block_table.shape[1]
    page = torch.where(in_table, block_table[slot].to(dev).long()[lb.clamp(max=block_table.shape[1] - 1)],
                       torch.full_like(t, -1))
    valid = (page >= 0) & (page < pages)
    flat = torch.where(valid, page * epb + t % epb, torch.zeros_like(t))
    data = pool.index_keys.flatten(0, 1)[flat]
    scale = pool.index_key_scale.flatten(0, 1)[flat]
    keys = dequantize_index_keys(data, scale, pool.index_numerics)
    return torch.where(valid[:, None], keys, torch.zeros((), device=dev)), valid


def score_keys(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """V4 indexer score of one query: q (H, Di), weights (H,), keys (T, Di) -> (T,) float32.

    ``score[t] = sum_h weights[h] * relu(q[h] . keys[t])``, computed in float64.
    """
    logits = keys.double() @ q.double().t()
    return (torch.relu(logits) * weights.double()[None, :]).sum(dim=1).float()


def indexer_scores(pool: PagedPool, block_table: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                   slots: torch.Tensor, n_entries: torch.Tensor, max_entries: int) -> torch.Tensor:
    """q: (B, H, Di) bf16, weights: (B, H) float32, n_entries: (B,) int -> scores (B, max_entries) float32.

    Entries ``t >= n_entries[b]`` and entries without storage (see :func:`entry_location`) score ``-inf``.
    """
    B = q.shape[0]
    scores = torch.full((B, max_entries), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        n = min(int(n_entries[b]), max_entries)
        if n <= 0:
            continue
        keys, valid = request_index_keys(pool, block_table, int(slots[b]), n)
        s = score_keys(q[b].float(), weights[b].float(), keys)
        scores[b, :n] = torch.where(valid, s, torch.full_like(s, float("-inf")))
    return scores


def select_topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Oracle of :func:`select_topk` by a stable descending sort (slower on GPU)."""
    k = min(k, scores.shape[1])
    values, order = torch.sort(scores, dim=1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    return torch.where(values == float("-inf"), torch.full_like(order, -1), order).to(torch.int32)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (B, T) float32 -> (B, min(k, T)) int32 entry indices, best first, ties to the lower index,
    -1 where the score is -inf (no entry). Graph-safe and sync-free.

    Each score is turned into a unique int64 key, ``(order-preserving int32 of the float) << 32 |
    (T - 1 - index)``, so ``torch.topk`` on the keys has no ties and its result is fully defined (same as
    a stable descending sort; -0.0 equals +0.0; NaN scores rank above +inf).
    """
    T = scores.shape[1]
    k = min(k, T)
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0 (equal scores, equal keys)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    index = torch.arange(T, device=scores.device, dtype=torch.int64)
    keys = (ordered << 32) | (T - 1 - index)
    top = torch.topk(keys, k, dim=1, sorted=True).values
    order = (T - 1) - (top & 0xFFFFFFFF)
    neg_inf = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF  # order-preserving int of -inf
    return torch.where((top >> 32) == neg_inf, torch.full_like(order, -1), order).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# sliding window
# ----------------------------------------------------------------------------------------------
def swa_append(swa: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               active: torch.Tensor) -> None:
    """swa: (S, window, D); kv: (B, D). Active row b writes ``swa[slots[b], positions[b] % window] = kv[b]``
    (rows whose slot is outside ``[0, S)`` or whose position is negative are skipped)."""
    window = swa.shape[1]
    for b in range(kv.shape[0]):
        if bool(active[b]) and 0 <= int(slots[b]) < swa.shape[0] and int(positions[b]) >= 0:
            swa[int(slots[b]), int(positions[b]) % window] = kv[b].to(swa.dtype)


# ----------------------------------------------------------------------------------------------
# decode simulation from the token history (float32, no paging, no incremental state)
# ----------------------------------------------------------------------------------------------
def pool_window(history: dict, entry_index: int, ratio: int, width: int, overlap: bool):
    """Pooled entry ``entry_index`` straight from a request's token history.

    history: {pos: (kv (C * D,) float32, score (C * D,) float32)}. Tokens absent from the history (before
    the request joined) are masked out. Main half: tokens of window ``entry_index`` (columns ``[D:]`` with
    overlap); overlap half: tokens of window ``entry_index - 1`` (columns ``[:D]``).
    """
    ks, zs = [], []
    a_off = width if overlap else 0
    if overlap:
        for pos in range((entry_index - 1) * ratio, entry_index * ratio):
            if pos >= 0 and pos in history:
                ks.append(history[pos][0][:width])
                zs.append(history[pos][1][:width])
    for pos in range(entry_index * ratio, (entry_index + 1) * ratio):
        if pos in history:
            ks.append(history[pos][0][a_off:a_off + width])
            zs.append(history[pos][1][a_off:a_off + width])
    k, z = torch.stack(ks), torch.stack(zs)
    return (k * torch.softmax(z, dim=0)).sum(dim=0)


class ReferenceDecodeSim:
    """Float32 decode simulation of one layer kind's cache from token histories (no paging, no tails).

    Per request: the token history, the stored entries (post-pool steps, then reference-quantized with the
    configured numerics, kept dequantized), the indexer keys (decoded) and the SWA window. Entries are pooled
    straight from the history with :func:`pool_window`, independently of the incremental state the kernels
    keep. Post-pool parameters: norm_weight (head_dim,), index_norm_weight (index_head_dim,) or None,
    rope_freqs (max_pos, rope_dim // 2) complex64.
    """

    def __init__(self, *, ratio: int, head_dim: int, rope_dim: int, index_head_dim: int | None, overlap: bool,
                 window: int, norm_weight: torch.Tensor, rope_freqs: torch.Tensor,
                 index_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 entry_numerics: str = "official", index_numerics: str = "official"):
        self.ratio, self.head_dim, self.rope_dim = ratio, head_dim, rope_dim
        self.index_head_dim, self.overlap, self.window = index_head_dim, overlap, window
        self.norm_weight, self.index_norm_weight, self.rope_freqs = norm_weight, index_norm_weight, rope_freqs
        self.eps, self.entry_numerics, self.index_numerics = eps, entry_numerics, index_numerics
        self.requests: dict = {}

    def join(self, rid) -> None:
        """A fresh request (position 0)."""
        self.requests[rid] = {"history": {}, "index_history": {}, "entries": {}, "raw": {}, "keys": {},
                              "raw_keys": {}, "swa": {}, "pos": 0}

    def leave(self, rid) -> None:
        del self.requests[rid]

    def prefill(self, rid, kv, score, swa_kv, index_kv=None, index_score=None) -> None:
        """Append T prompt tokens at once: kv, score (T, C * D) float32; swa_kv (T, D); index_* (T, C * Di)."""
        r = self.requests[rid]
        start, T = r["pos"], kv.shape[0]
        for i in range(T):
            r["history"][start + i] = (kv[i].float(), score[i].float())
            if index_kv is not None:
                r["index_history"][start + i] = (index_kv[i].float(), index_score[i].float())
        for pos in range(max(start, start + T - self.window), start + T):
            r["swa"][pos % self.window] = swa_kv[pos - start]
        r["pos"] = start + T
        for e in range(start // self.ratio, (start + T) // self.ratio):
            self._flush(r, e)

    def _flush(self, r, e) -> None:
        freqs = self.rope_freqs[e * self.ratio][None]
        pooled = pool_window(r["history"], e, self.ratio, self.head_dim, self.overlap)
        raw = post_pool(pooled[None], self.norm_weight, freqs, self.eps, rotate=False)
        r["raw"][e] = raw[0]
        r["entries"][e] = dequantize_entries(*quantize_entries(raw, self.rope_dim, self.entry_numerics))[0]
        if r["index_history"]:
            pooled = pool_window(r["index_history"], e, self.ratio, self.index_head_dim, self.overlap)
            key = post_pool(pooled[None], self.index_norm_weight, freqs, self.eps, rotate=True)
            r["raw_keys"][e] = key[0]
            r["keys"][e] = dequantize_index_keys(*quantize_index_keys(key, self.index_numerics),
                                                 self.index_numerics)[0]

    def step(self, rid, kv, score, swa_kv, index_kv=None, index_score=None):
        """Append the request's next token (1-D float32 projections); returns True when it flushed."""
        r = self.requests[rid]
        pos = r["pos"]
        r["history"][pos] = (kv.float(), score.float())
        if index_kv is not None:
            r["index_history"][pos] = (index_kv.float(), index_score.float())
        r["swa"][pos % self.window] = swa_kv
        r["pos"] = pos + 1
        if (pos + 1) % self.ratio:
            return False
        self._flush(r, pos // self.ratio)
        return True

    def n_entries(self, rid) -> int:
        return self.requests[rid]["pos"] // self.ratio

    def entries(self, rid) -> torch.Tensor:
        """(n_entries, head_dim) bf16: the stored entries, dequantized."""
        r = self.requests[rid]
        return torch.stack([r["entries"][e] for e in range(self.n_entries(rid))]) if self.n_entries(rid) else None

    def expected_tails(self, rid, width: int, history_key: str = "history"):
        """(tail_k (m, C*D), tail_z, tail_kb (m, D) | None, tail_zb, tail_len) the state should hold."""
        r, m = self.requests[rid], self.ratio
        hist = r[history_key]
        cols = (2 if self.overlap else 1) * width
        start = (r["pos"] // m) * m  # first position of the open window
        k = torch.zeros((m, cols))
        z = torch.full((m, cols), float("-inf"))
        for pos in range(start, r["pos"]):
            if pos in hist:
                k[pos - start], z[pos - start] = hist[pos]
        kb = zb = None
        if self.overlap:
            kb = torch.zeros((m, width))
            zb = torch.full((m, width), float("-inf"))
            for pos in range(start - m, start):
                if pos >= 0 and pos in hist:
                    kb[pos - start + m] = hist[pos][0][:width]
                    zb[pos - start + m] = hist[pos][1][:width]
        return k, z, kb, zb, r["pos"] - start

    def scores(self, rid, q: torch.Tensor, weights: torch.Tensor, max_entries: int) -> torch.Tensor:
        """(max_entries,) float32 indexer scores of one query (q (H, Di), weights (H,)) over the stored keys."""
        r = self.requests[rid]
        n = min(self.n_entries(rid), max_entries)
        scores = torch.full((max_entries,), float("-inf"))
        if n:
            keys = torch.stack([r["keys"][e] for e in range(n)])
            scores[:n] = score_keys(q.float(), weights.float(), keys)
        return scores

    def topk(self, rid, q: torch.Tensor, weights: torch.Tensor, max_entries: int, k: int) -> torch.Tensor:
        """Top-k entry indices (min(k, max_entries),) int32 of one query (q (H, Di), weights (H,))."""
        return select_topk(self.scores(rid, q, weights, max_entries)[None], k)[0]
