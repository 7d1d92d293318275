"""Pure-PyTorch reference of DeepSeek-V4's sparse MQA attention (NUMERICS.md ``sparse_attn``), float32 math.

Per query token ``n`` the row set is the concatenation of

* window rows ``window_kv[window_idx[n, w]]`` (bf16), and
* compressed entries ``entry_idx[n, k]`` of request slot ``slots[n]``: entry ``e`` lives at physical page
  ``block_table[slot, e // EPB]``, row ``e % EPB`` of the paged pool; its value is
  ``bf16(float(fp8[d]) * scale[d // SB])`` for ``d < nope`` and ``rope[d - nope]`` after.

An index is skipped (no memory access) when it is negative, a window id ``>= R``, an entry whose logical page
is ``>= L`` or whose physical page is outside ``[0, P)``, or any entry of a query whose slot is outside
``[0, S)``. Every listed valid index contributes once per listing (a repeated index counts twice, as in the
official kernel). Then, per head ``h`` (MQA: K = V = the D-wide row)::

    l_j = softmax_scale * q[n, h] . kv_j        (float32)
    m   = max_j l_j
    o   = sum_j exp(l_j - m) kv_j / (sum_j exp(l_j - m) + exp(attn_sink[h] - m))

and ``o = 0`` when the query has no valid row. Output bf16. The official kernel (and ours) rounds the
probabilities to bf16 for the P.V product; by default this reference does not (float32 throughout): the kernel
tests allow for it.

``p_rounding=(block_n, num_splits)`` instead mirrors the kernel's blockwise evaluation
(``megamoe/kernels/sparse_attention.py``), so that a reference model can follow the kernel to within the score
dot's summation order (issue 9): the row list ``[window rows | entry rows]`` is cut into blocks of ``block_n`` rows,
``cdiv(W, block_n)`` window blocks then ``cdiv(K, block_n)`` entry blocks (a block never straddles the two); the
blocks are split into contiguous ranges of ``blocks_per_split`` (:func:`split_layout` of ``num_splits`` for the
query, an int or one per query: the kernel's split count depends on the call's token count). Per range, from
``m = -inf``, an online softmax in the log2 domain (``s = q . kv * (softmax_scale * log2 e)`` in float32)::

    m' = max(m, max_j s_j);  alpha = 2^(m - m');  p_j = 2^(s_j - m')
    l  = l * alpha + sum_j p_j                      (float32 p)
    acc = acc * alpha + sum_j bf16(p_j) kv_j        (p rounded to bf16 for P.V only)

(``m'`` replaced by 0 in the exponents while it is ``-inf``). Ranges are merged in order 0, 1, ... with weights
``2^(m_s - max_s m_s)`` (l and acc alike), and ``o = acc / (l + 2^(sink * log2 e - m))`` cast to bf16. Rows past
a query's valid ones still occupy their place in a block, so ``W`` / ``K`` (and the padding) must be those of
the kernel call being mirrored.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

LOG2E = 1.4426950408889634


def dequantize_pool(entries_fp8: torch.Tensor, entries_scale: torch.Tensor, entries_rope: torch.Tensor
                    ) -> torch.Tensor:
    """(P, EPB, nope) fp8, (P, EPB, nope // SB) float32, (P, EPB, rope) bf16 -> (P * EPB, D) float32 rows."""
    nope = entries_fp8.shape[-1]
    sb = nope // entries_scale.shape[-1]
    scale = entries_scale.float().repeat_interleave(sb, dim=-1)
    value = (entries_fp8.float() * scale).to(torch.bfloat16).float()
    rows = torch.cat([value, entries_rope.float()], dim=-1)
    return rows.reshape(-1, rows.shape[-1])


def gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots, entry_idx):
    """The row set of every query: (kv (N, W + K, D) float32 with invalid rows zeroed, valid (N, W + K) bool)."""
    N = window_idx.shape[0]
    R, D = window_kv.shape
    P, epb = entries_fp8.shape[:2]
    S, L = block_table.shape
    dev = window_kv.device

    widx = window_idx.long()
    wvalid = (widx >= 0) & (widx < R)
    if R > 0:
        wrows = window_kv.float()[widx.clamp(0, R - 1)]
    else:
        wrows = torch.zeros(tuple(widx.shape) + (D,), device=dev)

    e = entry_idx.long()
    slot = slots.long()[:, None].expand_as(e)
    logical = torch.where(e >= 0, e // epb, torch.zeros_like(e))
    ok = (e >= 0) & (slot >= 0) & (slot < S) & (logical < L)
    if S > 0 and L > 0:
        page = block_table.long()[slot.clamp(0, S - 1), logical.clamp(0, L - 1)]
    else:
        page = torch.full_like(e, -1)
    evalid = ok & (page >= 0) & (page < P)
    if P > 0:
        pool = dequantize_pool(entries_fp8, entries_scale, entries_rope)
        flat = (page.clamp(0, P - 1) * epb + torch.where(e >= 0, e % epb, torch.zeros_like(e)))
        erows = pool[flat]
    else:
        erows = torch.zeros(tuple(e.shape) + (D,), device=dev)

    kv = torch.cat([wrows, erows], dim=1).reshape(N, -1, D)
    valid = torch.cat([wvalid, evalid], dim=1).reshape(N, -1)
    kv = torch.where(valid[..., None], kv, torch.zeros((), device=dev))
    return kv, valid


def split_layout(blocks: int, num_splits: int) -> tuple[int, int]:
    """(splits, blocks_per_split) of ``blocks`` row blocks asked to be cut into ``num_splits`` contiguous ranges:
    ``per = cdiv(blocks, num_splits)`` (``num_splits`` clamped to ``[1, max(blocks, 1)]``), every range non-empty."""
    num_splits = max(1, min(int(num_splits), max(blocks, 1)))
    per = max(-(-blocks // num_splits), 1)
    return -(-max(blocks, 1) // per), per


def _online_blocks(s, kv, blocks):
    """Online softmax over ``blocks`` ((start, stop) column ranges of s) from m = -inf: (m, l, acc) float32."""
    N, H, _ = s.shape
    dev = s.device
    m = torch.full((N, H), float("-inf"), device=dev)
    l = torch.zeros((N, H), device=dev)
    acc = torch.zeros((N, H, kv.shape[-1]), device=dev)
    for a, b in blocks:
        sb = s[:, :, a:b]
        m_new = torch.maximum(m, sb.amax(dim=-1))
        m_use = torch.where(m_new == float("-inf"), torch.zeros((), device=dev), m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(sb - m_use[..., None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("nhj,njd->nhd", p.to(torch.bfloat16).float(), kv[:, a:b])
        m = m_new
    return m, l, acc


def _blockwise_bf16_p(q, attn_sink, softmax_scale, kv, valid, W, K, block_n, num_splits):
    """The kernel's evaluation order (module doc, ``p_rounding``) for queries that share one split count."""
    dev = q.device
    s = torch.einsum("nhd,njd->nhj", q.float(), kv) * (float(softmax_scale) * LOG2E)
    s = torch.where(valid[:, None, :], s, torch.full((), float("-inf"), device=dev))
    blocks = [(a, min(a + block_n, W)) for a in range(0, W, block_n)] + \
        [(W + a, W + min(a + block_n, K)) for a in range(0, K, block_n)]
    splits, per = split_layout(len(blocks), num_splits)
    parts = [_online_blocks(s, kv, blocks[i * per:(i + 1) * per]) for i in range(splits)]
    if splits == 1:
        m, l, acc = parts[0]
    else:  # the combine: float32, splits in order
        m = torch.stack([part[0] for part in parts]).amax(dim=0)
        m_use = torch.where(m == float("-inf"), torch.zeros((), device=dev), m)
        l = torch.zeros_like(parts[0][1])
        acc = torch.zeros_like(parts[0][2])
        for m_s, l_s, acc_s in parts:
            wgt = torch.exp2(m_s - m_use)
            l = l + wgt * l_s
            acc = acc + wgt[..., None] * acc_s
    m_use = torch.where(m == float("-inf"), torch.zeros((), device=dev), m)
    o = acc / (l + torch.exp2(attn_sink.float()[None] * LOG2E - m_use))[..., None]
    return torch.where((m == float("-inf"))[..., None], torch.zeros((), device=dev), o)


def sparse_mqa_attention(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale,
                         entries_rope, block_table, slots, entry_idx, out=None,
                         p_rounding: tuple | None = None) -> torch.Tensor:
    """q (N, H, D) bf16, attn_sink (H,) float32 -> (N, H, D) bf16 (into ``out`` when given). See the module doc.

    p_rounding: None (float32 P, one pass) or ``(block_n, num_splits)``: the attention kernel's blockwise bf16-P
    evaluation with ``block_n``-row blocks; ``num_splits`` an int for every query or one per query (a sequence or
    an (N,) integer tensor), each cut as :func:`split_layout` of this call's ``cdiv(W, block_n) +
    cdiv(K, block_n)`` blocks (W = ``window_idx.shape[1]``, K = ``entry_idx.shape[1]``).
    """
    kv, valid = gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots,
                            entry_idx)
    if p_rounding is not None:
        block_n, num_splits = p_rounding
        N, W, K = q.shape[0], window_idx.shape[1], entry_idx.shape[1]
        if isinstance(num_splits, torch.Tensor):
            num_splits = num_splits.reshape(-1).tolist()
        if not isinstance(num_splits, Sequence):
            num_splits = [int(num_splits)] * N
        per_row = torch.tensor([int(v) for v in num_splits], dtype=torch.long, device=q.device)
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for value in sorted(set(int(v) for v in num_splits)):
            rows = (per_row == value).nonzero().reshape(-1)
            o[rows] = _blockwise_bf16_p(q[rows], attn_sink, softmax_scale, kv[rows], valid[rows], W, K,
                                        int(block_n), value)
        o = o.to(torch.bfloat16)
        if out is not None:
            out.copy_(o)
            return out
        return o
    logits = torch.einsum("nhd,njd->nhj", q.float(), kv) * float(softmax_scale)
    logits = torch.where(valid[:, None, :], logits, torch.full((), float("-inf"), device=q.device))
    m = logits.amax(dim=-1, keepdim=True) if logits.shape[-1] else \
        torch.full(logits.shape[:-1] + (1,), float("-inf"), device=q.device)
    m_use = torch.where(m == float("-inf"), torch.zeros((), device=q.device), m)
    p = torch.exp(logits - m_use)
    den = p.sum(dim=-1, keepdim=True) + torch.exp(attn_sink.float()[None, :, None] - m_use)
    o = torch.einsum("nhj,njd->nhd", p, kv) / den
    o = torch.where(valid.any(dim=-1)[:, None, None], o, torch.zeros((), device=q.device)).to(torch.bfloat16)
    if out is not None:
        out.copy_(o)
        return out
    return o
