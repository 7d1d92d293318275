"""Pure-PyTorch oracles of the expert-parallel exchange planning (``megamoe/kernels/ep_exchange.py``).

Same names, arguments and effects as the launchers there (they write the same output tensors); the module
docstring of the kernels states the layout. These also run the CPU (gloo) path of
:class:`megamoe.distributed.ExpertParallelMoE`.
"""
from __future__ import annotations

import torch


def _excl_cumsum(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


def ep_pack(x: torch.Tensor, inv_perm: torch.Tensor, sorted_expert: torch.Tensor, expert_offsets: torch.Tensor,
            send_x: torch.Tensor, send_counts: torch.Tensor, ret_row: torch.Tensor, *, top_k: int,
            num_local_experts: int, capacity_rows: int = 0, shared_base: int | None = None) -> None:
    num_tokens = x.shape[0]
    pairs = num_tokens * top_k
    num_experts = expert_offsets.shape[0]
    ends = expert_offsets.long()
    send_counts.copy_((ends - torch.cat((ends.new_zeros(1), ends[:-1]))).to(send_counts.dtype))
    if pairs == 0:
        return
    p = inv_perm.long()
    ok = (p >= 0) & (p < pairs)
    e = sorted_expert.long().index_select(0, torch.where(ok, p, 0))
    valid = ok & (e >= 0) & (e < num_experts)
    if capacity_rows:
        peer = torch.where(valid, e // num_local_experts, 0)
        first_of_peer = torch.cat((ends.new_zeros(1), ends))[peer * num_local_experts]  # ends[peer * EL - 1]
        slot = peer * capacity_rows + p - first_of_peer
    else:
        slot = p
    valid &= (slot >= 0) & (slot < send_x.shape[0])
    q = torch.arange(pairs, device=x.device)
    send_x.index_copy_(0, slot[valid], x.index_select(0, (q // top_k)[valid]))
    ret = ret_row.view(num_tokens, -1)
    ret[:, :top_k] = torch.where(valid, slot, -1).view(num_tokens, top_k).to(ret.dtype)
    if shared_base is not None:
        ret[:, top_k] = shared_base + torch.arange(num_tokens, device=x.device, dtype=ret.dtype)


def ep_local_order(recv_counts: torch.Tensor, row_index: torch.Tensor, back_index: torch.Tensor,
                   local_offsets: torch.Tensor, row_expert: torch.Tensor | None = None, *, world_size: int,
                   capacity_rows: int = 0) -> None:
    rows = row_index.shape[0]
    counts = recv_counts.long().clamp(min=0).view(world_size, -1)  # C (W, EL)
    w, el = counts.shape
    if capacity_rows:
        recv_base = torch.arange(w, device=counts.device) * capacity_rows
    else:
        recv_base = _excl_cumsum(counts.sum(1))
    src_start = (recv_base.unsqueeze(1) + _excl_cumsum(counts, 1)).reshape(-1)  # block (s, l) -> receive row
    src_end = src_start + counts.reshape(-1)
    em_counts = counts.t().reshape(-1)  # blocks in (l, s) order
    em_end = torch.cumsum(em_counts, 0)
    em_start = em_end - em_counts
    local_offsets.copy_(torch.cumsum(counts.sum(0), 0).to(local_offsets.dtype))
    total = em_end[-1:]
    q = torch.arange(rows, device=counts.device)
    nblocks = w * el
    b = torch.searchsorted(em_end, q, right=True).clamp_(max=nblocks - 1)  # block (l, s) of position q
    expert = torch.div(b, w, rounding_mode="floor")
    src_block = (b % w) * el + expert
    valid_q = q < total
    row_index.copy_(torch.where(valid_q, src_start.index_select(0, src_block) + q - em_start.index_select(0, b),
                                torch.zeros_like(q)).to(row_index.dtype))
    if row_expert is not None:
        row_expert.copy_(torch.where(valid_q, expert, torch.zeros_like(expert)))
    b2 = torch.searchsorted(src_end, q, right=True).clamp_(max=nblocks - 1)  # block (s, l) of receive row r
    start2 = src_start.index_select(0, b2)
    valid_r = (q >= start2) & (q < src_end.index_select(0, b2))
    em_block = (b2 % el) * w + torch.div(b2, el, rounding_mode="floor")
    back_index.copy_(torch.where(valid_r, em_start.index_select(0, em_block) + q - start2,
                                 torch.zeros_like(q)).to(back_index.dtype))
