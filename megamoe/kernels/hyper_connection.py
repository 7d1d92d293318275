"""Hyper-connection mixing weights of DeepSeek-V4 in one launch: sigmoid pre/post weights, Sinkhorn comb.

The PyTorch formula (``megamoe.reference.v4_numerics.hc_split_sinkhorn``) is ~60 tiny kernels per call (20
Sinkhorn iterations of two normalisations); a decode step calls it twice per layer. Here one program handles
``ROWS`` tokens, the (hc, hc) matrices stay in registers, the same float32 operation order as the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Tokens per program.
ROWS = 16


@triton.jit
def _hc_split_sinkhorn_kernel(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows,
                              eps, HC: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    M: tl.constexpr = (2 + HC) * HC
    h = tl.arange(0, HC)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    # pre / post: (ROWS, HC)
    m_pre = tl.load(mixes_ptr + rows[:, None] * M + h[None, :], mask=rmask[:, None], other=0.0)
    m_post = tl.load(mixes_ptr + rows[:, None] * M + HC + h[None, :], mask=rmask[:, None], other=0.0)
    pre = tl.sigmoid(m_pre * s0 + tl.load(base_ptr + h)[None, :]) + eps
    post = 2.0 * tl.sigmoid(m_post * s1 + tl.load(base_ptr + HC + h)[None, :])
    tl.store(pre_ptr + rows[:, None] * HC + h[None, :], pre, mask=rmask[:, None])
    tl.store(post_ptr + rows[:, None] * HC + h[None, :], post, mask=rmask[:, None])
    # comb: (ROWS, HC, HC), element [r, j, k] at mixes[2*HC + j*HC + k]
    jk = h[:, None] * HC + h[None, :]
    c = tl.load(mixes_ptr + rows[:, None, None] * M + 2 * HC + jk[None, :, :], mask=rmask[:, None, None], other=0.0)
    c = c * s2 + tl.load(base_ptr + 2 * HC + jk)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + jk[None, :, :], c, mask=rmask[:, None, None])


def launch_hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc: int,
                             iters: int, eps: float):
    """mixes (T, (2+hc)*hc) float32 contiguous -> (pre (T, hc), post (T, hc), comb (T, hc, hc)) float32."""
    T = mixes.shape[0]
    pre = torch.empty((T, hc), dtype=torch.float32, device=mixes.device)
    post = torch.empty((T, hc), dtype=torch.float32, device=mixes.device)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=mixes.device)
    if T:
        _hc_split_sinkhorn_kernel[(triton.cdiv(T, ROWS),)](
            mixes, hc_scale, hc_base, pre, post, comb, T, eps, HC=hc, ITERS=iters, ROWS=ROWS)
    return pre, post, comb
