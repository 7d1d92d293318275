"""Pure-PyTorch references of the compressed-cache steps (exact semantics the kernels reproduce).

Shapes: B rows of a decode batch; row ``b`` is request slot ``slots[b]`` at token position
``positions[b]`` (the position of the token this step appends) and takes part when ``active[b]``.
Entry index of the token at ``pos`` is ``pos // m``; a row *flushes* when it is active and
``(pos + 1) % m == 0``. Policies (zero/NaN entries, NVFP4 key global scale 1.0, top-k tie-break) are in
``megamoe/kvcache/config.py``.
"""
from __future__ import annotations

import torch

from ..kvcache.config import FP8_MAX, INDEX_KEY_GLOBAL_SCALE
from ..kvcache.state import CompressorState, PagedPool
from .quantize import dequantize, quantize
from ..format.tensor import NVFP4Tensor


# ----------------------------------------------------------------------------------------------
# entry / key quantization
# ----------------------------------------------------------------------------------------------
def quantize_entries(entry: torch.Tensor, rope_dim: int):
    """entry: (N, D) bf16 -> (fp8 (N, D - rope_dim) float8_e4m3fn, scale (N,) float32, rope (N, rope_dim) bf16).

    ``scale = amax / 448`` over the non-RoPE dims (float32); FP8 = e4m3_rne(clamp(x / scale, +-448)).
    All-zero entry: scale 0, x divided by 1 (signed zeros). Non-finite element: scale NaN, FP8 bytes 0.
    """
    x = entry.float()
    nope = x[:, : x.shape[1] - rope_dim]
    finite = torch.isfinite(nope).all(dim=1)
    amax = torch.where(torch.isfinite(nope), nope.abs(), torch.zeros((), device=x.device)).amax(dim=1)
    scale = amax / FP8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones((), device=x.device))
    q = torch.clamp(nope / divisor[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q_bytes = torch.where(finite[:, None], q.view(torch.uint8), torch.zeros((), dtype=torch.uint8, device=x.device))
    scale = torch.where(finite, scale, torch.full((), float("nan"), device=x.device))
    rope = entry[:, x.shape[1] - rope_dim:].to(torch.bfloat16)
    return q_bytes.view(torch.float8_e4m3fn), scale, rope


def dequantize_entries(fp8: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """(..., nope) fp8, (...,) float32, (..., rope) bf16 -> (..., nope + rope) bf16: ``bf16(fp8 * scale)``, rope as is."""
    nope = (fp8.float() * scale[..., None]).to(torch.bfloat16)
    return torch.cat([nope, rope.to(torch.bfloat16)], dim=-1)


def quantize_index_keys(key: torch.Tensor):
    """key: (N, Di) bf16 -> (data (N, Di // 2) uint8, block_scale (N, Di // 16) float8_e4m3fn).

    NVFP4 of ``megamoe.reference.quantize.quantize`` with the fixed global scale 1.0.
    """
    gs = torch.full((), INDEX_KEY_GLOBAL_SCALE, dtype=torch.float32, device=key.device)
    t = quantize(key.float(), global_scale=gs)
    return t.data, t.block_scale


def dequantize_index_keys(data: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """(..., Di // 2) uint8, (..., Di // 16) e4m3 -> (..., Di) float32 (exact)."""
    shape = tuple(data.shape[:-1]) + (data.shape[-1] * 2,)
    gs = torch.full((), INDEX_KEY_GLOBAL_SCALE, dtype=torch.float32, device=data.device)
    return dequantize(NVFP4Tensor(data, block_scale, gs, shape), torch.float32)


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
    """
    m, d = state.ratio, state.width
    B = kv.shape[0]
    pooled = torch.zeros((B, d), dtype=torch.float32, device=kv.device) if pooled_out is None else pooled_out.clone()
    flush = torch.zeros((B,), dtype=torch.bool, device=kv.device)
    a_off = d if state.overlap else 0
    for b in range(B):
        if not bool(active[b]):
            continue
        s, pos = int(slots[b]), int(positions[b])
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
def entry_location(block_table: torch.Tensor, slot: int, entry_index: int, entries_per_block: int):
    """(physical page, slot in page) of a request's entry, or None when its page is not allocated."""
    lb = entry_index // entries_per_block
    if lb >= block_table.shape[1]:
        return None
    page = int(block_table[slot, lb])
    return None if page < 0 else (page, entry_index % entries_per_block)


def flush_write(pool: PagedPool, block_table: torch.Tensor, entry: torch.Tensor, index_key: torch.Tensor | None,
                flush: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, ratio: int) -> None:
    """Quantize and scatter the entries of the rows with ``flush[b]`` (no-op for the others).

    entry: (B, head_dim) bf16; index_key: (B, index_head_dim) bf16 or None (HCA).
    Row b goes to entry ``positions[b] // ratio`` of slot ``slots[b]`` via ``block_table (S, L) int32``
    (-1 = unallocated page: the row is skipped).
    """
    epb = pool.entries_scale.shape[1]
    rope_dim = pool.entries_rope.shape[-1]
    fp8, scale, rope = quantize_entries(entry, rope_dim)
    if index_key is not None:
        kdata, kscale = quantize_index_keys(index_key)
    for b in range(entry.shape[0]):
        if not bool(flush[b]):
            continue
        loc = entry_location(block_table, int(slots[b]), int(positions[b]) // ratio, epb)
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
    """Dequantize selected entries: indices (B, K) int (-1 = none) -> (B, K, head_dim) bf16 (zeros for -1)."""
    B, K = indices.shape
    epb = pool.entries_scale.shape[1]
    d = pool.entries_fp8.shape[-1] + pool.entries_rope.shape[-1]
    out = torch.zeros((B, K, d), dtype=torch.bfloat16, device=indices.device)
    for b in range(B):
        for j in range(K):
            t = int(indices[b, j])
            loc = None if t < 0 else entry_location(block_table, int(slots[b]), t, epb)
            if loc is None:
                continue
            p, e = loc
            out[b, j] = dequantize_entries(pool.entries_fp8[p, e], pool.entries_scale[p, e], pool.entries_rope[p, e])
    return out


def request_index_keys(pool: PagedPool, block_table: torch.Tensor, slot: int, count: int) -> torch.Tensor:
    """A request's first ``count`` indexer keys decoded to float32: (count, Di)."""
    epb = pool.entries_scale.shape[1]
    di = pool.index_keys.shape[-1] * 2
    keys = torch.zeros((count, di), dtype=torch.float32, device=pool.index_keys.device)
    for t in range(count):
        loc = entry_location(block_table, slot, t, epb)
        if loc is not None:
            keys[t] = dequantize_index_keys(pool.index_keys[loc], pool.index_key_scale[loc])
    return keys


def score_keys(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """V4 indexer score of one query: q (H, Di), weights (H,), keys (T, Di) -> (T,) float32.

    ``score[t] = sum_h weights[h] * relu(q[h] . keys[t])``, computed in float64.
    """
    logits = keys.double() @ q.double().t()
    return (torch.relu(logits) * weights.double()[None, :]).sum(dim=1).float()


def indexer_scores(pool: PagedPool, block_table: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                   slots: torch.Tensor, n_entries: torch.Tensor, max_entries: int) -> torch.Tensor:
    """q: (B, H, Di) bf16, weights: (B, H) float32, n_entries: (B,) int -> scores (B, max_entries) float32.

    Entries ``t >= n_entries[b]`` score ``-inf``.
    """
    B = q.shape[0]
    scores = torch.full((B, max_entries), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        n = min(int(n_entries[b]), max_entries)
        if n <= 0:
            continue
        keys = request_index_keys(pool, block_table, int(slots[b]), n)
        scores[b, :n] = score_keys(q[b].float(), weights[b].float(), keys)
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
    """swa: (S, window, D); kv: (B, D). Active row b writes ``swa[slots[b], positions[b] % window] = kv[b]``."""
    window = swa.shape[1]
    for b in range(kv.shape[0]):
        if bool(active[b]):
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

    Per request: the token history, the stored entries (reference-quantized, kept dequantized), the
    NVFP4 index keys (decoded) and the SWA window. Entries are pooled straight from the history with
    :func:`pool_window`, independently of the incremental state the kernels keep.
    """

    def __init__(self, *, ratio: int, head_dim: int, rope_dim: int, index_head_dim: int | None, overlap: bool,
                 window: int):
        self.ratio, self.head_dim, self.rope_dim = ratio, head_dim, rope_dim
        self.index_head_dim, self.overlap, self.window = index_head_dim, overlap, window
        self.requests: dict = {}

    def join(self, rid, start_pos: int, prefill_entries: torch.Tensor, prefill_keys: torch.Tensor | None) -> None:
        """A request joins at ``start_pos`` with ``start_pos // m`` entries already written by prefill
        (prefill_entries (n, head_dim) bf16, prefill_keys (n, index_head_dim) bf16 or None)."""
        r = {"history": {}, "index_history": {}, "entries": {}, "raw": {}, "keys": {}, "swa": {}, "pos": start_pos}
        for e in range(prefill_entries.shape[0]):
            self._store(r, e, prefill_entries[e:e + 1], None if prefill_keys is None else prefill_keys[e:e + 1])
        self.requests[rid] = r

    def leave(self, rid) -> None:
        del self.requests[rid]

    def _store(self, r, e, entry_bf16, key_bf16):
        fp8, scale, rope = quantize_entries(entry_bf16, self.rope_dim)
        r["entries"][e] = dequantize_entries(fp8, scale, rope)[0]
        r["raw"][e] = entry_bf16[0]
        if key_bf16 is not None:
            r["keys"][e] = dequantize_index_keys(*quantize_index_keys(key_bf16))[0]

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
        e = pos // self.ratio
        entry = pool_window(r["history"], e, self.ratio, self.head_dim, self.overlap).to(torch.bfloat16)
        key = None
        if index_kv is not None:
            key = pool_window(r["index_history"], e, self.ratio, self.index_head_dim, self.overlap)
            key = key.to(torch.bfloat16)[None]
        self._store(r, e, entry[None], key)
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
