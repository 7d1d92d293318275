"""Expert-parallel exchange on the device: the send packing, the receive-side order and the peer-to-peer stores.

Three kernels, one launcher each, one launch per call. The pure-PyTorch oracles of ``ep_pack`` and
``ep_local_order`` (same names) are in ``megamoe/reference/ep_exchange.py`` and run the CPU path; ``ep_put_rows``
addresses other GPUs and is CUDA only (its CPU counterpart is NCCL's / gloo's all-to-all).

Notation: W ranks, E routed experts, EL = E / W local experts per rank (rank r owns ``[r * EL, (r + 1) * EL)``),
k slots per token, P = T * k pairs. ``cap``: rows per rank pair in capacity mode (0 = exact mode).

:func:`ep_pack` (before the exchange). From ``megamoe.ops.moe.dispatch``'s outputs (``inv_perm``,
``sorted_expert``, ``expert_offsets``) and the token rows ``x`` (T, H) bf16 it writes

* ``send_counts`` (E,) int32: the pairs per expert, ``expert_offsets`` differenced;
* ``send_x`` rows: pair ``q = t*k + j`` sorted at ``p = inv_perm[q]`` for expert ``e`` (peer ``e // EL``) goes to
  send row ``slot = p`` (exact mode: the sorted order, split by peer) or
  ``slot = peer * cap + p - (first sorted row of that peer)`` (capacity mode: one fixed block per peer);
  the row written is ``x[t]``;
* ``ret_row`` (T, RS) int32, column j = ``slot`` of pair (t, j): the row of the returned expert output that the
  combine reads (the return exchange mirrors the send); ``-1`` for a dropped pair (expert id outside [0, E):
  ``sorted_expert`` = E), which the combine drops. With ``shared_base`` (RS = k + 1), column k = ``shared_base
  + t``: the row where the fused shared expert's output is placed.

:func:`ep_local_order` (after the counts exchange). From the received counts ``C`` (W, EL) int32 (rows that
source s sends for local expert l; source s's rows start at receive row ``s * cap`` in capacity mode, at the
sum of the earlier sources' rows in exact mode, ordered by local expert, then the sender's order) it writes

* ``row_index`` (rows,) int32: the receive row of expert-major position q (expert l: source 0's rows, then
  source 1's, ...); 0 for padding positions q >= sum(C);
* ``back_index`` (rows,) int32: the expert-major position of receive row r; 0 for receive rows no source sent;
* ``local_offsets`` (EL,) int32: cumulative row ends of the local experts in expert-major order;
* optionally ``row_expert`` (rows,) int64: the local expert of position q (0 for padding).

:func:`ep_put_rows` (the peer-to-peer exchange, ``megamoe/distributed/peer_exchange.py``): for each rank
``peer``, the first ``n_peer`` rows of ``src``'s block ``[peer * cap, (peer + 1) * cap)`` are stored into that
rank's workspace at rows ``my_rank * cap + i`` of the region at ``dst_offset`` bytes, where ``n_peer`` is the
sum of ``counts[peer * EL:(peer + 1) * EL]`` (the send counts before the GEMMs, the received counts after: only
the rows that exist move; with ``src_index`` the row read is ``src[src_index[peer * cap + i]]``, the return
exchange's gather from the expert-major GEMM output). With ``counts_dst_offset``,
``counts[peer * EL:(peer + 1) * EL]`` goes to that rank's counts region at ``my_rank * EL``. Addresses come from
``peer_base`` (W,) int64; the caller's barrier makes the stores visible.

All are sync-free and graph-capturable: sizes come from the host (T, rows, cap), values stay on the device.
Every store is masked to its buffer (the peer stores to the sender's block of ``cap`` rows), so inconsistent counts
cannot write out of bounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# ep_pack: BLOCK_P pairs per program, rows copied BLOCK_H columns at a time (16-byte bf16 vectors at 4 warps).
PACK_CONFIG = {"BLOCK_P": 8, "BLOCK_H": 1024, "num_warps": 4}
# ep_put_rows: PROGS programs per destination rank, each storing every PROGS-th row (8 KB at H = 4096).
PUT_CONFIG = {"PROGS": 16, "BLOCK_H": 2048, "num_warps": 4}
# ep_local_order: one program per (source, local expert) block + one for the padding; BLOCK rows per step.
ORDER_CONFIG = {"BLOCK": 128, "num_warps": 4}
INTERPRETER_PACK_CONFIG = {"BLOCK_P": 4, "BLOCK_H": 32, "num_warps": 1}
INTERPRETER_ORDER_CONFIG = {"BLOCK": 8, "num_warps": 1}


@triton.jit
def _ep_pack_kernel(x_ptr, stride_x, inv_perm_ptr, sorted_expert_ptr, offsets_ptr, send_ptr, stride_send,
                    send_rows, counts_ptr, ret_ptr, P, H, E, EL, CAP, shared_base,
                    K: tl.constexpr, RS: tl.constexpr, SHARED: tl.constexpr, CAPACITY: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:  # per-expert send counts
        ex = tl.arange(0, BLOCK_E)
        me = ex < E
        ends = tl.load(offsets_ptr + ex, mask=me, other=0)
        starts = tl.load(offsets_ptr + ex - 1, mask=me & (ex > 0), other=0)
        tl.store(counts_ptr + ex, ends - starts, mask=me)
    q = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    mq = q < P
    p = tl.load(inv_perm_ptr + q, mask=mq, other=-1)
    mp = mq & (p >= 0) & (p < P)
    e = tl.load(sorted_expert_ptr + p, mask=mp, other=-1).to(tl.int32)
    valid = mp & (e >= 0) & (e < E)
    if CAPACITY:
        peer = tl.where(valid, e // EL, 0)
        first = tl.load(offsets_ptr + peer * EL - 1, mask=valid & (peer > 0), other=0)
        slot = peer * CAP + p - first
    else:
        slot = p
    valid = valid & (slot >= 0) & (slot < send_rows)
    t = q // K
    tl.store(ret_ptr + t * RS + (q - t * K), tl.where(valid, slot, -1), mask=mq)
    if SHARED:
        tl.store(ret_ptr + t * RS + K, shared_base + t, mask=mq & (q - t * K == 0))
    slot64 = slot.to(tl.int64)
    t64 = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    h0 = 0
    while h0 < H:  # (a while loop: the interpreter cannot range() over a scalar argument)
        c = h0 + cols
        m = valid[:, None] & (c < H)[None, :]
        v = tl.load(x_ptr + t64[:, None] * stride_x + c[None, :], mask=m)
        tl.store(send_ptr + slot64[:, None] * stride_send + c[None, :], v, mask=m)
        h0 += BLOCK_H


@triton.jit
def _ep_local_order_kernel(counts_ptr, row_index_ptr, back_index_ptr, local_offsets_ptr, row_expert_ptr, rows, CAP,
                           W: tl.constexpr, EL: tl.constexpr, W_P2: tl.constexpr, EL_P2: tl.constexpr,
                           CAPACITY: tl.constexpr, HAS_ROW_EXPERT: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)  # block b = s * EL + l of C, or W * EL: the padding program
    s2 = tl.arange(0, W_P2)[:, None]
    l2 = tl.arange(0, EL_P2)[None, :]
    m2 = (s2 < W) & (l2 < EL)
    c = tl.load(counts_ptr + s2 * EL + l2, mask=m2, other=0).to(tl.int32)
    c = tl.maximum(c, 0)
    col = tl.sum(c, axis=0)  # (EL_P2,) rows per local expert
    loc_end = tl.cumsum(col, axis=0)
    em_start = (loc_end - col)[None, :] + (tl.cumsum(c, axis=0) - c)  # expert-major start of block (s, l)
    row_sum = tl.sum(c, axis=1)  # (W_P2,) rows per source
    if CAPACITY:
        base = tl.arange(0, W_P2) * CAP
    else:
        base = tl.cumsum(row_sum, axis=0) - row_sum
    src_start = base[:, None] + (tl.cumsum(c, axis=1) - c)  # receive row of block (s, l)'s first row
    cols = tl.arange(0, BLOCK)
    if b < W * EL:
        sel = ((s2 * EL + l2) == b) & m2
        n = tl.sum(tl.where(sel, c, 0))
        em0 = tl.sum(tl.where(sel, em_start, 0))
        src0 = tl.sum(tl.where(sel, src_start, 0))
        if b == 0:
            lx = tl.arange(0, EL_P2)
            tl.store(local_offsets_ptr + lx, loc_end, mask=lx < EL)
        i = 0
        while i < n:
            idx = i + cols
            m = idx < n
            q = em0 + idx
            r = src0 + idx
            tl.store(row_index_ptr + q, r, mask=m & (q < rows))
            tl.store(back_index_ptr + r, q, mask=m & (r < rows) & (r >= 0))
            if HAS_ROW_EXPERT:
                tl.store(row_expert_ptr + q, (b % EL).to(tl.int64) + tl.zeros_like(q).to(tl.int64),
                         mask=m & (q < rows))
            i += BLOCK
    else:  # padding: positions past the total, receive rows no source sent (capacity mode)
        q = tl.sum(col)
        while q < rows:
            idx = q + cols
            m = idx < rows
            tl.store(row_index_ptr + idx, tl.zeros_like(idx), mask=m)
            if HAS_ROW_EXPERT:
                tl.store(row_expert_ptr + idx, tl.zeros_like(idx).to(tl.int64), mask=m)
            q += BLOCK
        if CAPACITY:
            for s in tl.static_range(W):
                r = s * CAP + tl.sum(tl.where(tl.arange(0, W_P2) == s, row_sum, 0))
                end = (s + 1) * CAP
                while r < end:
                    idx = r + cols
                    tl.store(back_index_ptr + idx, tl.zeros_like(idx), mask=(idx < end) & (idx < rows))
                    r += BLOCK


@triton.jit
def _ep_put_rows_kernel(src_ptr, stride_src, src_index_ptr, peer_base_ptr, dst_offset, counts_ptr, counts_dst_offset,
                        CAP, MY_RANK, H, W: tl.constexpr, EL: tl.constexpr, EL_P2: tl.constexpr,
                        PUT_COUNTS: tl.constexpr, HAS_INDEX: tl.constexpr, PROGS: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    peer = pid // PROGS
    j = pid - peer * PROGS
    lx = tl.arange(0, EL_P2)
    peer_counts = tl.load(counts_ptr + peer * EL + lx, mask=lx < EL, other=0)
    n = tl.minimum(tl.sum(tl.maximum(peer_counts, 0)), CAP)
    base = tl.load(peer_base_ptr + peer)
    dst = (base + dst_offset).to(tl.pointer_type(tl.bfloat16))
    if PUT_COUNTS:
        if j == 0:
            cdst = (base + counts_dst_offset).to(tl.pointer_type(tl.int32))
            tl.store(cdst + MY_RANK * EL + lx, peer_counts, mask=lx < EL)
    cols = tl.arange(0, BLOCK_H)
    i = j
    while i < n:
        src_row = (peer * CAP + i).to(tl.int64)
        if HAS_INDEX:  # gather: row src_index[peer * cap + i] of src
            src_row = tl.load(src_index_ptr + src_row).to(tl.int64)
        dst_row = (MY_RANK * CAP + i).to(tl.int64)
        h0 = 0
        while h0 < H:
            c = h0 + cols
            v = tl.load(src_ptr + src_row * stride_src + c, mask=c < H)
            tl.store(dst + dst_row * H + c, v, mask=c < H)
            h0 += BLOCK_H
        i += PROGS


def _interpret(t: torch.Tensor) -> bool:
    return not t.is_cuda


def ep_pack(x: torch.Tensor, inv_perm: torch.Tensor, sorted_expert: torch.Tensor, expert_offsets: torch.Tensor,
            send_x: torch.Tensor, send_counts: torch.Tensor, ret_row: torch.Tensor, *, top_k: int,
            num_local_experts: int, capacity_rows: int = 0, shared_base: int | None = None) -> None:
    """Launch the pack kernel (module docstring). x (T, H) bf16 rows of unit column stride; inv_perm (T*k,)
    int32; sorted_expert (T*k,) int32/int64; expert_offsets (E,) int32; send_x (>= rows, H) bf16 (unit column
    stride) whose first W * capacity_rows (capacity) or T*k (exact) rows are written where a pair lands;
    send_counts (E,) int32; ret_row (T, k) or (T, k + 1) int32 contiguous (k + 1 with ``shared_base``).
    capacity_rows 0 = exact mode. T = 0 writes only send_counts."""
    num_tokens, hidden = x.shape
    pairs = num_tokens * top_k
    num_experts = expert_offsets.shape[0]
    cfg = INTERPRETER_PACK_CONFIG if _interpret(x) else PACK_CONFIG
    rs = top_k + (1 if shared_base is not None else 0)
    if pairs == 0:  # only the counts are written; an empty x may carry no device pointer
        x = send_x
    grid = (max(1, triton.cdiv(pairs, cfg["BLOCK_P"])),)
    _ep_pack_kernel[grid](
        x, x.stride(0), inv_perm, sorted_expert, expert_offsets, send_x, send_x.stride(0), send_x.shape[0],
        send_counts, ret_row, pairs, hidden, num_experts, num_local_experts, capacity_rows,
        0 if shared_base is None else shared_base,
        K=top_k, RS=rs, SHARED=shared_base is not None, CAPACITY=capacity_rows > 0,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=cfg["BLOCK_P"], BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg["num_warps"],
    )


def ep_local_order(recv_counts: torch.Tensor, row_index: torch.Tensor, back_index: torch.Tensor,
                   local_offsets: torch.Tensor, row_expert: torch.Tensor | None = None, *, world_size: int,
                   capacity_rows: int = 0) -> None:
    """Launch the receive-order kernel (module docstring). recv_counts (W * EL,) int32 = C row-major;
    row_index, back_index (rows,) int32; local_offsets (EL,) int32; row_expert None or (rows,) int64.
    capacity_rows 0 = exact mode (rows = sum(C))."""
    num_experts = recv_counts.shape[0]
    el = num_experts // world_size
    cfg = INTERPRETER_ORDER_CONFIG if _interpret(recv_counts) else ORDER_CONFIG
    _ep_local_order_kernel[(num_experts + 1,)](
        recv_counts, row_index, back_index, local_offsets, row_index if row_expert is None else row_expert,
        row_index.shape[0], capacity_rows,
        W=world_size, EL=el, W_P2=triton.next_power_of_2(world_size), EL_P2=triton.next_power_of_2(el),
        CAPACITY=capacity_rows > 0, HAS_ROW_EXPERT=row_expert is not None, BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
    )


def ep_put_rows(src: torch.Tensor, peer_base: torch.Tensor, dst_offset: int, counts: torch.Tensor, *,
                capacity_rows: int, my_rank: int, counts_dst_offset: int | None = None,
                src_index: torch.Tensor | None = None) -> None:
    """Launch the peer-to-peer row stores (module docstring). src (W * cap, H) bf16, unit column stride (each
    destination region is (rows, H) contiguous), or with ``src_index`` ((W * cap,) int32) any (R, H) bf16 whose
    row ``src_index[peer * cap + i]`` is sent as row i to ``peer``; peer_base (W,) int64 workspace addresses;
    counts (E,) int32; offsets in bytes. CUDA only (the stores address other GPUs)."""
    world = peer_base.shape[0]
    num_experts = counts.shape[0]
    el = num_experts // world
    cfg = PUT_CONFIG
    _ep_put_rows_kernel[(world * cfg["PROGS"],)](
        src, src.stride(0), counts if src_index is None else src_index, peer_base, dst_offset, counts,
        0 if counts_dst_offset is None else counts_dst_offset, capacity_rows, my_rank, src.shape[1], W=world, EL=el,
        EL_P2=triton.next_power_of_2(el), PUT_COUNTS=counts_dst_offset is not None, HAS_INDEX=src_index is not None,
        PROGS=cfg["PROGS"], BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg["num_warps"],
    )
