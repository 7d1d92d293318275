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
probabilities to bf16 for the P.V product; this reference does not (float32 throughout): the tests allow for it.
"""
from __future__ import annotations

import torch


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


def sparse_mqa_attention(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale,
                         entries_rope, block_table, slots, entry_idx, out=None) -> torch.Tensor:
    """q (N, H, D) bf16, attn_sink (H,) float32 -> (N, H, D) bf16 (into ``out`` when given). See the module doc."""
    kv, valid = gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots,
                            entry_idx)
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
