"""Issue 9 diagnostics: a blockwise bf16-P mirror of the sparse attention kernel (its BLOCK_N row blocks, its
split-KV partition and fixed-order combine, P rounded to bf16 before P.V as the kernel and the official
``sparse_attn`` do), for comparing the kernel with ``megamoe.reference.attention.sparse_mqa_attention`` (float32 P).
Used by diag_v4_attn_bf16p.py and diag_v4_kernel_bisect.py."""
import math

import torch

from megamoe.kernels import sparse_attention as KA
from megamoe.reference import attention as RA


def mirror(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
           block_table, slots, entry_idx, out=None, block_n=None, num_splits=None, **_):
    interp = not q.is_cuda
    dv = q.device
    if block_n is None:
        block_n = (KA.INTERPRETER_CONFIG if interp else KA.ATTENTION_CONFIG)["BLOCK_N"]
    kv, valid = RA.gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots, entry_idx)
    W, K = window_idx.shape[1], entry_idx.shape[1]
    c = float(softmax_scale) * math.log2(math.e)
    s = torch.einsum("nhd,njd->nhj", q.float(), kv) * c
    s = torch.where(valid[:, None, :], s, torch.full((), float("-inf"), device=dv))
    N, H, _ = s.shape
    blocks = [(a, min(a + block_n, W)) for a in range(0, W, block_n)] + \
        [(W + a, W + min(a + block_n, K)) for a in range(0, K, block_n)]
    if num_splits is None:
        num_splits = KA.choose_num_splits(N, H, W, K, interpreter=interp)[0]
    splits, per = KA.split_layout(len(blocks), num_splits)
    parts = []
    for sp in range(splits):  # each split: its own online softmax from m = -inf, as the kernel
        m = torch.full((N, H), float("-inf"), device=dv); l = torch.zeros(N, H, device=dv); acc = torch.zeros(N, H, kv.shape[-1], device=dv)
        for a, b in blocks[sp * per:(sp + 1) * per]:
            sb = s[:, :, a:b]
            m_new = torch.maximum(m, sb.amax(-1))
            mu = torch.where(m_new == float("-inf"), torch.zeros((), device=dv), m_new)
            alpha = torch.exp2(m - mu); p = torch.exp2(sb - mu[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("nhj,njd->nhd", p.to(torch.bfloat16).float(), kv[:, a:b])
            m = m_new
        parts.append((m, l, acc))
    if splits == 1:
        m, l, acc = parts[0]
    else:  # the combine kernel: fixed order, float32
        m = torch.stack([q_[0] for q_ in parts]).amax(0)
        mu = torch.where(m == float("-inf"), torch.zeros((), device=dv), m)
        l = torch.zeros(N, H, device=dv); acc = torch.zeros(N, H, kv.shape[-1], device=dv)
        for m_s, l_s, a_s in parts:
            wgt = torch.exp2(m_s - mu); l = l + wgt * l_s; acc = acc + wgt[..., None] * a_s
    mu = torch.where(m == float("-inf"), torch.zeros((), device=dv), m)
    den = l + torch.exp2(attn_sink.float()[None] * math.log2(math.e) - mu)
    o = acc / den[..., None]
    return torch.where(valid.any(-1)[:, None, None], o, torch.zeros((), device=dv)).to(torch.bfloat16)
