"""Stateless float reference of one DeepSeek-V4 attention layer over a whole sequence.

It restates the official ``Attention.forward`` / ``Compressor.forward`` / ``Indexer.forward`` prefill math
(``start_pos = 0``; read from the vendored V4-Flash ``inference/model.py``) with ``sparse_attn`` of ``kernel.py``
(``/work/plan/NUMERICS.md``). Every query position ``t`` sees exactly what a decode step at ``t`` sees, so the
same outputs are the per-step targets of a cache-based implementation.

Numerics. The official model runs with default dtype bf16 and this reference rounds to bf16 at the same points,
computing each op in float32 from the bf16 operands (what a bf16 op does):

* linear outputs (``wq_a``, ``wq_b``, ``wkv``, indexer ``wq_b`` / ``weights_proj``, the grouped ``wo_a`` einsum,
  ``wo_b``) are bf16: ``bf16(x.float() @ W.T)`` with float32 weights (exactly decoded NVFP4 / bf16);
* RMSNorm, RoPE, Hadamard and the FP8/FP4 simulations output bf16 (:mod:`.v4_numerics`);
* q's per-head norm is the official bf16 expression ``q * rsqrt(q.square().mean(-1) + eps)`` with each of its
  five bf16 ops rounded (:func:`head_rms_norm`);
* the compressors project ``x.float()`` with float32 weights and pool in float32 (official: "compression need
  fp32"); the pooled entry is cast to bf16 before its norm;
* indexer scores: ``bf16(q . k)`` per head, ReLU, ``bf16(* w_h)``, ``bf16(sum over heads)``; weights
  ``w = bf16(bf16(weights_proj(x)) * float32(index_head_dim**-0.5 * index_n_heads**-0.5))``;
* attention logits ``float32(q . kv) * head_dim**-0.5``, ``p = exp(l - max)`` in float32, the sink adds
  ``exp(sink - max)`` to the denominator only, ``o = bf16(p) @ kv / denominator`` cast to bf16. The official
  kernel runs this online over blocks of 64 selected rows (each block's ``p`` rounded to bf16 relative to the
  running max); with more than 64 rows the two agree to bf16 rounding, not bit for bit.

Selection: query ``t`` attends to window positions ``max(0, t - window + 1) .. t`` and compressed entries
``j < (t + 1) // ratio`` (HCA: all of them; CSA: the indexer's top ``index_topk`` of those, ties broken towards
the lower entry index, as this package's cache does; ``torch.topk`` in the official code leaves ties unspecified).
Entry ``j`` pools tokens ``j*ratio .. j*ratio + ratio - 1`` (CSA also the previous group through the overlap half
of its projections) and is rotated at position ``j * ratio``.

``numerics="per_entry"``: the compressed entries (what the paged cache stores in FP8) take one float32 scale
``amax / 448`` per entry over the non-RoPE dims (:func:`megamoe.reference.kvcache.quantize_entries`) instead of
the official power-of-two scale per 64 elements. The window kv keeps the official simulation (the window cache
holds bf16) and the indexer keys stay official.

``numerics="blocks"``: the fast path's numerics from the megamoe block references: official FP8 entries and FP4
keys, float32 indexer scores (as ``official_fp32_index``), pooling by :func:`megamoe.reference.kvcache.prefill_pool`,
and the sparse attention of :func:`megamoe.reference.attention.sparse_mqa_attention` (float32 ``p`` without the
bf16 rounding, the attention kernel's oracle) over the rows in the layer's order (window descending from ``t``,
then the selected entries read back from the stored FP8 pool). ``indices`` / ``topk`` are reported as for the
other modes.
``p_rounding`` ("blocks" only): the attention kernel's blockwise bf16-P evaluation instead
(``sparse_mqa_attention(..., p_rounding=...)``): ``(block_n, num_splits, entry_columns)`` with ``num_splits``
one split count per query (the fast call that computed the query picked it from its token count) and
``entry_columns`` the entry list width of the fast call (its window list is ``window_size`` wide); the query's
rows are padded with -1 to those widths, so that they fall into the same row blocks and split ranges as in the
fast call. :func:`megamoe.reference.v4_model.kernel_p_rounding` derives it from a fast model's shapes.

``numerics="official_fp32_index"``: official storage, but the indexer scores are summed in float32 without the bf16
roundings (what megamoe's indexer kernel computes). The bf16 scores of the official model tie often, and the
official ``torch.topk`` orders ties arbitrarily; with float32 scores the top-k is fully defined, so a fast path
can be compared with it token for token.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..models.config import CSA_RATIO, V4Config
from .attention import sparse_mqa_attention
from .forced import follow, index_score_bounds
from .kvcache import dequantize_entries, prefill_pool, quantize_entries
from .v4_numerics import (
    apply_rope,
    fp4_block_simulate,
    fp8_block_simulate,
    hadamard_rotate,
    rms_norm,
    rope_frequencies,
)

NUMERICS = ("official", "per_entry", "official_fp32_index", "blocks")
#: Queries per chunk of the dense attention (bounds the (chunk, heads, keys) logits tensor).
QUERY_CHUNK = 256

_BF16 = torch.bfloat16


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(_BF16)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An official bf16 ``Linear``: ``bf16(x.float() @ weight.float().T)``."""
    return _bf16(x.float() @ weight.float().t())


def head_rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Official per-head q norm ``q * rsqrt(q.square().mean(-1) + eps)`` evaluated op by op in ``q.dtype``.

    For bf16 ``q`` every op (square, mean, + eps, rsqrt, product) is computed in float32 and rounded to bf16, as
    the official bf16 model does; for float32 ``q`` it is the plain float32 expression.
    """
    dt = q.dtype
    sq = (q.float() * q.float()).to(dt)
    mean = sq.float().mean(-1, keepdim=True).to(dt)
    r = torch.rsqrt((mean.float() + eps).to(dt).float()).to(dt)
    return (q.float() * r.float()).to(dt)


def rope_table(cfg: V4Config, layer: int, positions: int, device=None) -> torch.Tensor:
    """(positions, rope_dim // 2) complex64: compressed layers use YaRN with ``compress_rope_theta``, window-only
    layers plain RoPE with ``rope_theta`` (official ``Attention.__init__``)."""
    if cfg.compress_ratios[layer]:
        f = rope_frequencies(cfg.rope_dim, positions, base=cfg.compress_rope_theta,
                             original_seq_len=cfg.original_seq_len, factor=cfg.rope_factor,
                             beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow)
    else:
        f = rope_frequencies(cfg.rope_dim, positions, base=cfg.rope_theta)
    return f.to(device) if device is not None else f


def _weights_getter(w: Mapping, layer: int):
    prefix = f"layers.{layer}.attn."

    def get(name: str) -> torch.Tensor:
        t = w.get(prefix + name)
        return w[name] if t is None else t

    return get


def compressor_projections(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor):
    """Float32 projections a compressor keeps per token: ``(kv (T, C), score (T, C))``, ``score`` including
    ``ape[t % ratio]`` (C = coff * width). These are the official ``kv_state`` / ``score_state`` rows."""
    xf = x.float()
    ratio = ape.shape[0]
    kv = xf @ wkv.float().t()
    score = xf @ wgate.float().t()
    pos = torch.arange(x.shape[0], device=x.device) % ratio
    return kv, score + ape.float()[pos]


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """Float32 pooled entries (T // ratio, width) from :func:`compressor_projections`.

    Entry j: per feature, ``softmax`` of the scores over its slots, times kv, summed. HCA (C = width): the slots
    are the ``ratio`` tokens of group j. CSA (ratio 4, C = 2 * width): the previous group's tokens through the
    first (overlap) half ``[:width]`` and group j's tokens through the second half ``[width:]`` (group -1 does not
    exist: kv 0, score -inf).
    """
    n = kv.shape[0] // ratio
    kv_g = kv[: n * ratio].view(n, ratio, kv.shape[1])
    sc_g = score[: n * ratio].view(n, ratio, score.shape[1])
    if kv.shape[1] == 2 * width:
        prev_kv = torch.cat([kv_g.new_zeros(1, ratio, width), kv_g[:-1, :, :width]])[:n]
        prev_sc = torch.cat([sc_g.new_full((1, ratio, width), float("-inf")), sc_g[:-1, :, :width]])[:n]
        kv_g = torch.cat([prev_kv, kv_g[:, :, width:]], dim=1)
        sc_g = torch.cat([prev_sc, sc_g[:, :, width:]], dim=1)
    return (kv_g * sc_g.softmax(dim=1)).sum(dim=1)


def _entries(pooled: torch.Tensor, norm_w: torch.Tensor, freqs: torch.Tensor, ratio: int, eps: float) -> torch.Tensor:
    """Pooled float32 entries -> bf16 after the official cast, RMSNorm and RoPE at position ``j * ratio``."""
    e = rms_norm(_bf16(pooled), norm_w, eps)
    return apply_rope(e, freqs[0: ratio * e.shape[0]: ratio])


def _simulate_kv(kv: torch.Tensor, rope_dim: int, per_entry: bool) -> torch.Tensor:
    """FP8 simulation of the non-RoPE dims (official: 64-blocks; ``per_entry``: one amax/448 scale per row)."""
    if per_entry:
        return dequantize_entries(*quantize_entries(kv, rope_dim, numerics="per_entry"))
    nope = fp8_block_simulate(kv[..., :-rope_dim], 64)
    return torch.cat([nope, kv[..., -rope_dim:]], dim=-1)


def visible_entries(seq_len: int, ratio: int, device=None) -> torch.Tensor:
    """(T, T // ratio) bool: entry j is visible to query t when ``j < (t + 1) // ratio``."""
    t = torch.arange(seq_len, device=device)
    j = torch.arange(seq_len // ratio, device=device)
    return j[None, :] < ((t + 1) // ratio)[:, None]


def window_indices(seq_len: int, window: int, device=None) -> torch.Tensor:
    """(T, min(T, window)) int64 window positions of each query in the official prefill order: ascending from
    ``max(0, t - window + 1)``, -1 past ``t`` (official ``get_window_topk_idxs`` with ``start_pos = 0``)."""
    t = torch.arange(seq_len, device=device)[:, None]
    pos = (t - window + 1).clamp_min(0) + torch.arange(min(seq_len, window), device=device)
    return torch.where(pos > t, -1, pos)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
    """Official indexer score, bf16-rounded as the bf16 model computes it.

    q: (T, nh, dh) bf16 (FP4-simulated); weights: (T, nh) bf16 (already scaled); keys: (N, dh) bf16.
    Returns (T, N) float32 holding bf16 values: ``bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h))``;
    ``exact``: the same sum in float64 without the roundings, as float32.
    """
    if exact:
        s = torch.einsum("thd,nd->thn", q.double(), keys.double()).clamp_min(0) * weights.double()[..., None]
        return s.sum(dim=1).float()
    s = _bf16(torch.einsum("thd,nd->thn", q.float(), keys.float()))
    s = _bf16(s.float().clamp_min(0) * weights.float()[..., None])
    return _bf16(s.float().sum(dim=1)).float()


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """(T, N) scores, (T, N) visibility -> (T, min(k, N)) int32 entry indices, best first, -1 past the visible ones.

    Ties: the lower entry index first (stable descending sort).
    """
    n = min(k, scores.shape[1])
    key = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :n]
    ok = visible.gather(1, order)
    return torch.where(ok, order, torch.full_like(order, -1)).to(torch.int32)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``sparse_attn`` of the official kernel in one pass: q (T, H, D) bf16, kv (N, D) bf16 (K = V), sink (H,)
    float32, indices (T, K) int rows of ``kv`` per query (-1 = skipped) -> o (T, H, D) bf16.

    ``l = scale * q . kv_j`` (float32), ``m = max l``, ``p = exp(l - m)``,
    ``o = sum_j bf16(p_j) kv_j / (sum_j p_j + exp(sink - m))``; a query with no valid row gets 0.
    """
    out = torch.empty(q.shape, dtype=_BF16, device=q.device)
    sink = sink.float()
    for start in range(0, q.shape[0], QUERY_CHUNK):
        idx = indices[start: start + QUERY_CHUNK].long()
        valid = idx >= 0
        rows = torch.where(valid[..., None], kv[idx.clamp_min(0)], kv.new_zeros(())).float()
        logits = torch.einsum("thd,tjd->thj", q[start: start + QUERY_CHUNK].float(), rows)
        logits = logits.masked_fill(~valid[:, None, :], float("-inf")) * torch.tensor(scale, dtype=torch.float32,
                                                                                     device=q.device)
        m = logits.amax(dim=-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m[..., None])
        denom = p.sum(-1) + torch.exp(sink - m)
        o = torch.einsum("thj,tjd->thd", _bf16(p).float(), rows) / denom[..., None]
        out[start: start + QUERY_CHUNK] = _bf16(o)
    return out


def attention_forward(cfg: V4Config, layer: int, w: Mapping, x: torch.Tensor, *, numerics: str = "official",
                      p_rounding: tuple | None = None, forced_topk: torch.Tensor | None = None,
                      decisions_mode: str = "force", decision_report: list | None = None) -> dict:
    """One DeepSeek-V4 attention layer over a whole sequence (see the module docstring for the exact numerics).

    cfg, layer: the model and the layer index (its ``compress_ratios`` entry picks window / CSA / HCA).
    w: decoded weights (float32 of NVFP4 / bf16; float32 / fp32 tensors) by official name, either full
    (``layers.{layer}.attn.wq_a.weight``) or relative to the attention module (``wq_a.weight``).
    x: (T, hidden) bf16, the layer input after ``attn_norm``.
    p_rounding: ``numerics="blocks"`` only: None (float32 P) or ``(block_n, num_splits (T,), entry_columns)``, the
    attention kernel's bf16-P evaluation (module docstring).
    forced_topk: CSA layers, ``numerics="blocks"`` only (ignored by other layers): (T' >= T, n) int another
    implementation's selected entries per query (best first, -1 = none), followed where the reference's own
    float64 scores leave them tied (:func:`megamoe.reference.forced.follow` with
    :func:`~megamoe.reference.forced.index_score_bounds`; ``decisions_mode`` / ``decision_report`` as there).
    Returns a dict:

    * ``out`` (T, hidden) float32 (bf16 values): the attention output (``wo_b``);
    * ``q`` (T, n_heads, head_dim) bf16 after the per-head norm and RoPE; ``qr`` (T, q_lora_rank) bf16;
    * ``window_kv`` (T, head_dim) bf16: the token's kv after norm, RoPE and the FP8 simulation;
    * ``entries`` (T // ratio, head_dim) bf16 compressed entries after norm, RoPE and the FP8 simulation
      (None for window-only layers); ``comp_kv`` / ``comp_score`` (T, coff * head_dim) float32: the compressor's
      per-token projections (score including ``ape``), the official ``kv_state`` / ``score_state`` rows;
    * ``topk`` (T, n) int32 compressed entry indices per query (-1 = none): CSA the indexer's top-k
      (n = min(index_topk, T // ratio)), HCA every visible entry (n = T // ratio), window layers n = 0;
    * ``indices`` (T, min(T, window) + n) int64: the rows each query attends in ``cat(window_kv, entries)``
      (window positions ascending, then ``T + topk``; -1 = skipped), the official prefill ``topk_idxs``;
    * CSA only (else None): ``index_keys`` (T // ratio, index_head_dim) bf16 after norm, RoPE, Hadamard and the
      FP4 simulation; ``index_q`` (T, index_n_heads, index_head_dim) bf16 after RoPE, Hadamard, FP4;
      ``index_weights`` (T, index_n_heads) bf16; ``index_scores`` (T, T // ratio) float32 (bf16 values, -inf
      where not visible); ``index_comp_kv`` / ``index_comp_score`` as ``comp_kv`` / ``comp_score``.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
    if p_rounding is not None and numerics != "blocks":
        raise ValueError(f"p_rounding: only with numerics='blocks', got numerics={numerics!r}")
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x: expected (T, {cfg.hidden_size}), got {tuple(x.shape)}")
    get = _weights_getter(w, layer)
    T, dev = x.shape[0], x.device
    h, d, rd, eps = cfg.num_heads, cfg.head_dim, cfg.rope_dim, cfg.norm_eps
    ratio = cfg.compress_ratios[layer]
    freqs = rope_table(cfg, layer, max(T, 1), dev)[:T]
    x = _bf16(x)

    # q: wq_a -> q_norm -> wq_b -> per-head norm -> RoPE
    qr = rms_norm(linear_bf16(x, get("wq_a.weight")), get("q_norm.weight"), eps)
    q = linear_bf16(qr, get("wq_b.weight")).view(T, h, d)
    q = apply_rope(head_rms_norm(q, eps), freqs)

    # window kv: wkv -> kv_norm -> RoPE -> FP8 simulation of the non-RoPE dims (64-blocks, official)
    kv = apply_rope(rms_norm(linear_bf16(x, get("wkv.weight")), get("kv_norm.weight"), eps), freqs)
    window_kv = _simulate_kv(kv, rd, per_entry=False)

    res = {"q": q, "qr": qr, "window_kv": window_kv, "entries": None, "comp_kv": None, "comp_score": None,
           "index_keys": None, "index_q": None, "index_weights": None, "index_scores": None,
           "index_comp_kv": None, "index_comp_score": None}
    indices = window_indices(T, cfg.window_size, dev)
    keys_all = window_kv
    topk = torch.empty((T, 0), dtype=torch.int32, device=dev)
    blocks = numerics == "blocks"
    stored = None  # "blocks": the entries as the paged pool stores them (fp8, scale, rope)
    if ratio:
        ck, cs = compressor_projections(x, get("compressor.wkv.weight"), get("compressor.wgate.weight"),
                                        get("compressor.ape"))
        if blocks:
            pooled = prefill_pool(ck, cs, ratio, d, ratio == CSA_RATIO)[0]
            raw = _entries(pooled, get("compressor.norm.weight"), freqs, ratio, eps)
            stored = quantize_entries(raw, rd, numerics="official")
            entries = dequantize_entries(*stored)
        else:
            pooled = compressor_pool(ck, cs, ratio, d)
            entries = _simulate_kv(_entries(pooled, get("compressor.norm.weight"), freqs, ratio, eps), rd,
                                   per_entry=numerics == "per_entry")
        n = entries.shape[0]
        visible = visible_entries(T, ratio, dev)
        if ratio == CSA_RATIO:
            idx = _indexer(cfg, get, x, qr, freqs, eps, exact=numerics in ("official_fp32_index", "blocks"),
                           blocks=blocks)
            res.update(idx)
            topk = select_topk(idx["index_scores"], visible, cfg.index_topk)
            if forced_topk is not None:
                if not blocks:
                    raise ValueError(f"forced_topk: only with numerics='blocks', got numerics={numerics!r}")
                key, lo, hi = index_score_bounds(idx["index_scores"], idx["index_q"], idx["index_weights"],
                                                 idx["index_keys"])
                topk = follow("index", layer, key, lo, hi, topk, forced_topk, visible, mode=decisions_mode,
                              report=decision_report)
            res["index_scores"] = idx["index_scores"].masked_fill(~visible, float("-inf"))
        else:
            j = torch.arange(n, device=dev, dtype=torch.int32).expand(T, n)
            topk = torch.where(visible, j, torch.full_like(j, -1))
        # entries follow the T window rows in the attended kv (official prefill: offset = T)
        indices = torch.cat([indices, torch.where(topk >= 0, topk.long() + T, -1)], dim=1)
        keys_all = torch.cat([window_kv, entries])
        res.update(entries=entries, comp_kv=ck, comp_score=cs)
    res.update(topk=topk, indices=indices)
    if blocks:
        o = _blocks_attention(q, window_kv, stored, topk, get("attn_sink"), cfg, p_rounding)
    else:
        o = sparse_attention(q, keys_all, get("attn_sink"), indices, d ** -0.5)
    o = apply_rope(o, freqs, inverse=True)
    g = cfg.o_groups
    wo_a = get("wo_a.weight").float().view(g, cfg.o_lora_rank, -1)
    o = _bf16(torch.einsum("tgd,grd->tgr", o.float().view(T, g, -1), wo_a))
    res["out"] = linear_bf16(o.flatten(1), get("wo_b.weight")).float()
    return res


def _blocks_attention(q: torch.Tensor, window_kv: torch.Tensor, stored, topk: torch.Tensor, sink: torch.Tensor,
                      cfg: V4Config, p_rounding: tuple | None = None) -> torch.Tensor:
    """``numerics="blocks"``: the sparse attention as :func:`megamoe.reference.attention.sparse_mqa_attention`
    (the attention kernel's oracle: float32 logits and probabilities, ``P`` not rounded to bf16; with
    ``p_rounding`` the kernel's blockwise bf16 P) over the rows in the fast path's order: window positions
    ``t, t-1, ..., t-window+1`` (descending, as the layer's ring lookup lists them), then the selected entries read
    from a one-page pool holding the stored FP8 entries."""
    T, dev = q.shape[0], q.device
    win = min(cfg.window_size, T)
    kernel_rounding = None
    if p_rounding is not None:  # the fast call's list widths: window_size, entry_columns (padding -1)
        block_n, num_splits, entry_columns = p_rounding
        win = cfg.window_size
        if topk.shape[1] > entry_columns:
            raise ValueError(f"p_rounding: entry_columns={entry_columns} is narrower than the {topk.shape[1]} "
                             "selected entries")
        topk = torch.cat([topk, topk.new_full((T, entry_columns - topk.shape[1]), -1)], dim=1)
        kernel_rounding = (block_n, num_splits)
    window_idx = torch.arange(T, device=dev, dtype=torch.int32)[:, None] - torch.arange(win, device=dev,
                                                                                        dtype=torch.int32)
    window_idx = torch.where(window_idx >= 0, window_idx, -1)
    if stored is None:  # window-only layer: an empty pool, no entries selected
        nope, rd = cfg.head_dim - cfg.rope_dim, cfg.rope_dim
        stored = (torch.zeros((0, nope), dtype=torch.float8_e4m3fn, device=dev),
                  torch.zeros((0, nope // 64), dtype=torch.float32, device=dev),
                  torch.zeros((0, rd), dtype=_BF16, device=dev))
    fp8, scale, rope = stored
    n = fp8.shape[0]
    pages = (fp8[None], scale[None], rope[None]) if n else (
        fp8.new_zeros((1, 1) + fp8.shape[1:]), scale.new_zeros((1, 1) + scale.shape[1:]),
        rope.new_zeros((1, 1) + rope.shape[1:]))
    return sparse_mqa_attention(
        q, sink.float(), cfg.head_dim ** -0.5, window_kv=window_kv, window_idx=window_idx, entries_fp8=pages[0],
        entries_scale=pages[1], entries_rope=pages[2], block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev),
        slots=torch.zeros((T,), dtype=torch.int32, device=dev), entry_idx=topk.to(torch.int32),
        p_rounding=kernel_rounding)


def _indexer(cfg: V4Config, get, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor, eps: float, *,
             exact: bool = False, blocks: bool = False) -> dict:
    """The CSA indexer over the whole sequence: queries, scaled head weights, keys, scores (unmasked).
    ``blocks``: keys pooled by :func:`megamoe.reference.kvcache.prefill_pool` (the cache's prefill pooling)."""
    T = x.shape[0]
    nh, dh = cfg.index_n_heads, cfg.index_head_dim
    q = linear_bf16(qr, get("indexer.wq_b.weight")).view(T, nh, dh)
    q = fp4_block_simulate(hadamard_rotate(apply_rope(q, freqs)), 32)
    scale = torch.tensor(dh ** -0.5 * nh ** -0.5, dtype=torch.float32, device=x.device)
    weights = _bf16(linear_bf16(x, get("indexer.weights_proj.weight")).float() * scale)
    ck, cs = compressor_projections(x, get("indexer.compressor.wkv.weight"), get("indexer.compressor.wgate.weight"),
                                    get("indexer.compressor.ape"))
    pooled = prefill_pool(ck, cs, CSA_RATIO, dh, True)[0] if blocks else compressor_pool(ck, cs, CSA_RATIO, dh)
    keys = _entries(pooled, get("indexer.compressor.norm.weight"), freqs, CSA_RATIO, eps)
    keys = fp4_block_simulate(hadamard_rotate(keys), 32)
    return {"index_q": q, "index_weights": weights, "index_keys": keys,
            "index_scores": index_scores(q, weights, keys, exact=exact), "index_comp_kv": ck, "index_comp_score": cs}
