"""Decode MoE router + dispatch in one launch: gate GEMV, scoring, bias, top-k, renormalisation, scaling and
the expert grouping (offsets / sorted experts / row index / inverse permutation).

One kernel, one launcher (:func:`launch_route_dispatch`), meant for decode-sized batches (T <= a few tens of
tokens; the op picks it from the token count, a host shape). It replaces the gate GEMM, the scoring ops,
``_moe_topk_kernel`` and ``_moe_dispatch_kernel`` (5-6 launches plus copies).

**Stage 1, gate GEMV** (every program; v2): program ``(pid_e, pid_s)`` loads its gate tile (``BLOCK_E``
experts x ``CHUNK`` of H, fp32/bf16 -> fp32, about 32 values per thread, every load in flight at once), then
for the tokens in blocks of ``TB`` (a runtime loop) loads x (bf16/fp32 -> fp32) and sums the fp32 products
(per-thread chains, then a fixed tree; no tensor cores). Below ``SPLIT_H_MIN_TOKENS`` (64) tokens the tile is
one expert x the whole H (H <= 8192: no partials): the logits go straight to ``logits (T, E)``. Otherwise (16
experts x 256/512 of H) the partials go to a workspace ``(splits, T, E)``; after a CTA barrier the program draws a
ticket on its expert block's counter (``atomic_add``, acq_rel, gpu scope) and the program drawing ticket
``splits - 1`` sums the block's partials as one tile (tree over the split axis) into ``logits`` and resets the
counter. The order of every sum is fixed by the launch shape, not by arrival order: the same bits on every run,
eager or graph replay.

**Stage 2, finish** (the last program of the launch: ticket ``e_blocks - 1`` on the final counter):

* per block of ``BT`` tokens: scores (``sqrtsoftplus`` = ``sqrt(softplus)`` with torch's threshold 20,
  ``sigmoid`` or ``softmax`` over E), key ``= score + bias`` (one fp32 add) with NaN keys -> -inf, then
  ``TOP_K`` rounds of one packed int64 max (order-preserving int32 image of the key in the high word,
  ``E_PAD - 1 - expert`` in the low word: ties -> lower expert index, as the reference's stable sort);
  weights = the unbiased scores of the chosen experts, ``/ (sum + 1e-20)`` with ``NORMALIZE``, times the
  routed scaling factor; stored to the strided ``(T, >=k)`` outputs. Hash routing (``HASH``): the ids are
  the token's ``tid2eid`` row (invalid token id / entry -> ids 0..k-1, NaN weights, flagged in the error
  word as ``route`` ``token_ids`` / ``tid2eid``, exactly as ``moe_router``).
* dispatch of the ``T * SLOTS`` pairs (``SLOTS`` = k, or k+1 when the caller preset extra id columns, e.g.
  the fused shared expert's id E): one ``tl.histogram`` of the bins (inclusive prefix sum ->
  ``expert_offsets``) and one ``tl.sort`` of the packed keys ``bin * P + t * S_PAD + slot`` (P = T_PAD *
  S_PAD): position i of the sorted keys is the row of that pair (``sorted_expert``, ``row_index``,
  ``inv_perm``). This is the stable sort by expert, so the outputs equal the torch / ``moe_dispatch`` paths'
  bit for bit. An id outside ``[0, num_groups)`` is grouped as the pseudo-expert ``num_groups`` after every
  real one and flags ``dispatch`` ``topk_ids`` (as ``moe_dispatch``); padding pairs use bin ``BINS - 1``
  (``BINS >= num_groups + 2``).

The finish is the only serial part; its loops are runtime loops so that the code stays small (v1 unrolled
it: 16-42 K SASS instructions run once from a cold instruction cache, the likely bulk of its 100-480 us).

**Counters** (:func:`route_dispatch_counters`): one int32 vector of :data:`COUNTER_SLOTS` zeros per device
(slots ``0..e_blocks-1`` per expert block when H is split, slot ``e_blocks`` the final one), allocated outside graph
capture and cached; every launch leaves it zero. Two launches on different streams of one device must not
run concurrently.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_flags

COUNTER_SLOTS = 1024
_COUNTERS: dict = {}
SCORING_CODES = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}
INTERPRETER_PROGRAMS = 8  # "SM count" the interpreter plans for (several splits at test sizes)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def route_dispatch_counters(device) -> torch.Tensor | None:
    """The (COUNTER_SLOTS,) int32 counters of ``device`` (zeros; every launch leaves them zero), or None while
    the current stream captures a CUDA graph and none exist yet (the caller then takes the unfused path)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


#: From this many tokens (padded to a power of two) the gate GEMV splits H over programs of 16 experts (partials and a
#: per-block ticket); below, one program per expert takes the whole H (plan_route_dispatch). 8 until 2026-11-26; H100
#: (bench_route.py, bf16 gate, gpu_check_v23/route_split): one program per expert is faster at 8 / 16 / 32 tokens,
#: V4-Flash 25.3 / 40.0 / 59.3 -> 17.6 / 25.3 / 40.4 us, V4-Pro 44.6 / 77.6 / 117.9 -> 33.0 / 54.2 / 96.7 us.
SPLIT_H_MIN_TOKENS = 64
#: Experts per GEMV program below SPLIT_H_MIN_TOKENS (each program takes whole rows of H: E / SMALL_T_BLOCK_E programs,
#: each drawing one ticket on the final counter). 1 since v2.
SMALL_T_BLOCK_E = 1


def plan_route_dispatch(num_tokens: int, num_experts: int, hidden: int, programs: int) -> dict:
    """Launch shape from host sizes only (``programs``, the SM count, is unused since v2: the tiles fix it).

    GEMV tile (BLOCK_E experts x CHUNK of H, loaded at once: about 32 fp32 per thread): below 8 tokens one
    expert x the whole H (up to 8192: no partials, no per-block ticket), from 8 tokens 16 experts x 256/512
    of H with the fp32 FMA ``tl.dot``. TB: tokens per GEMV step, TBR: tokens per partial-sum step, BT: tokens
    per top-k step (all runtime loops: the code stays small, its instruction fetch cheap)."""
    t_pad = triton.next_power_of_2(max(num_tokens, 1))
    h_pad = triton.next_power_of_2(max(hidden, 16))
    use_dot = False  # the fp32 FMA tl.dot keeps whole K rows per thread: stack (local memory) at these tiles
    if t_pad >= SPLIT_H_MIN_TOKENS:
        num_warps = 8 if t_pad >= 32 else 4
        block_e, chunk = 16, min(h_pad, 64 * num_warps)
        tb = max(1, min(t_pad, 64 * 32 * num_warps // (block_e * chunk)))
    else:
        num_warps = 8 if h_pad >= 4096 else 4
        block_e, chunk = SMALL_T_BLOCK_E, min(h_pad, 1024 * num_warps)
        tb = max(1, min(t_pad, 64 * 32 * num_warps // (chunk * block_e)))
    threads = 32 * num_warps
    e_blocks = triton.cdiv(num_experts, block_e)
    splits = triton.cdiv(hidden, chunk)
    splits_pad = triton.next_power_of_2(splits)
    tbr = max(1, min(t_pad, 32 * threads // (splits_pad * block_e)))
    e_pad = triton.next_power_of_2(num_experts)
    bt = max(1, min(t_pad, 8 * threads // e_pad))
    return dict(T_PAD=t_pad, USE_DOT=use_dot, BLOCK_E=block_e, CHUNK=chunk, TB=tb, e_blocks=e_blocks,
                splits=splits, SPLITS_PAD=splits_pad, TBR=tbr, BT=bt, num_warps=num_warps)


@triton.jit
def _scores(logits, valid, SCORING: tl.constexpr):
    """(BT, E_PAD) fp32 logits -> scores; ``valid`` masks the padded experts (softmax over the valid ones)."""
    if SCORING == 0:
        s = 1.0 / (1.0 + tl.exp(-logits))
    elif SCORING == 1:
        z = tl.where(valid, logits, float("-inf"))
        m = tl.max(z, axis=1)
        p = tl.where(valid, tl.exp(z - m[:, None]), 0.0)
        s = p / tl.sum(p, axis=1)[:, None]
    else:
        # softplus with torch's threshold (z > 20 -> z), log1p(exp(z)) for the rest; log1p(t) = log(u) * t / (u-1)
        # with u = 1 + t (exact when u == 1: t), accurate for tiny t
        # NaN-propagating: a plain minimum is min.f32 on the GPU, which returns 20 for a NaN logit (a finite score
        # sqrt(20) instead of NaN -> key -inf); the interpreter kept NaN, so only the GPU differed
        t = tl.exp(tl.minimum(logits, 20.0, propagate_nan=tl.PropagateNan.ALL))
        u = 1.0 + t
        lp = tl.where(u == 1.0, t, tl.log(u) * (t / (u - 1.0)))
        s = tl.sqrt(tl.where(logits > 20.0, logits, lp))
    return s


@triton.jit
def _finish_tokens(ws_ptr, bias_ptr, weights_ptr, ids_ptr, token_ids_ptr, tid2eid_ptr, err_ptr, num_tokens,
                   num_experts, vocab, stride_t, stride_w, stride_i, routed_scaling_factor, t0,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr,
                   SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, HASH: tl.constexpr,
                   FLAG_TOKENS: tl.constexpr, FLAG_TABLE: tl.constexpr):
    """Route tokens [t0, t0 + BT): scores from the (T, E) logits in ``ws_ptr``, selection, weights, stores."""
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < num_tokens
    cols = tl.arange(0, E_PAD)
    valid = cols[None, :] < num_experts
    mask = row_ok[:, None] & valid
    logits = tl.load(ws_ptr + rows.to(tl.int64)[:, None] * num_experts + cols[None, :], mask=mask, other=0.0,
                     cache_modifier=".cg")
    scores = _scores(logits, valid, SCORING)
    slots = tl.arange(0, K_PAD)
    keep = slots < TOP_K
    chosen_w = tl.zeros((BT, K_PAD), dtype=tl.float32)
    chosen_i = tl.zeros((BT, K_PAD), dtype=tl.int32)
    if HASH:
        tok = tl.load(token_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        tok_ok = (tok >= 0) & (tok < vocab)
        table = tl.load(tid2eid_ptr + tl.where(tok_ok, tok, 0)[:, None] * stride_t + slots[None, :],
                        mask=row_ok[:, None] & keep[None, :] & tok_ok[:, None], other=0)
        bad_entry = tl.max(tl.where(keep[None, :] & ((table < 0) | (table >= num_experts)), 1, 0), axis=1)
        ok = tok_ok & (bad_entry == 0)
        if FLAG_TOKENS | FLAG_TABLE != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0)
            bad_tok = tl.max((row_ok & ~tok_ok).to(tl.int32), axis=0)
            bad_row = tl.max((row_ok & tok_ok & (bad_entry != 0)).to(tl.int32), axis=0)
            code = bad_tok * FLAG_TOKENS | bad_row * FLAG_TABLE
            tl.atomic_or(err_ptr, code, mask=code != 0)
        chosen_i = tl.where(ok[:, None], table, slots[None, :]).to(tl.int32)
        for j in tl.static_range(TOP_K):
            idj = tl.sum(tl.where(slots[None, :] == j, chosen_i, 0), axis=1)
            w = tl.sum(tl.where(cols[None, :] == idj[:, None], scores, 0.0), axis=1)
            chosen_w = tl.where(slots[None, :] == j, w[:, None], chosen_w)
    else:
        key = scores
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + cols, mask=cols < num_experts, other=0.0)[None, :]
        key = tl.where(key != key, float("-inf"), key) + 0.0  # NaN -> -inf; -0.0 -> +0.0 (equal keys tie)
        bits = key.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order == float order
        packed = (ordered.to(tl.int64) << 32) | (E_PAD - 1 - cols[None, :]).to(tl.int64)
        lowest = -9223372036854775807 - 1
        packed = tl.where(valid, packed, lowest)
        for j in tl.static_range(TOP_K):
            best = tl.max(packed, axis=1)
            idx = E_PAD - 1 - best.to(tl.int32)  # the low word (truncation)
            hit = cols[None, :] == idx[:, None]
            packed = tl.where(hit, lowest, packed)
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            chosen_w = tl.where(slots[None, :] == j, w[:, None], chosen_w)
            chosen_i = tl.where(slots[None, :] == j, idx[:, None], chosen_i)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=1)[:, None] + 1e-20)
    chosen_w = chosen_w * routed_scaling_factor
    if HASH:
        chosen_w = tl.where(ok[:, None], chosen_w, float("nan"))
    out_mask = row_ok[:, None] & keep[None, :]
    r64 = rows.to(tl.int64)[:, None]
    tl.store(weights_ptr + r64 * stride_w + slots[None, :], chosen_w, mask=out_mask)
    tl.store(ids_ptr + r64 * stride_i + slots[None, :], chosen_i, mask=out_mask)


@triton.jit
def _group_pairs(ids_ptr, stride_i, offsets_ptr, sorted_expert_ptr, row_index_ptr, inv_perm_ptr, err_ptr,
                 num_tokens, num_groups, SLOTS: tl.constexpr, S_PAD: tl.constexpr, T_PAD: tl.constexpr,
                 BINS: tl.constexpr, ERR_FLAG: tl.constexpr):
    """Stable grouping of the T * SLOTS pairs of ``ids`` (module docstring): one sort of the packed keys
    ``bin * P + pair`` (P = T_PAD * S_PAD; padding pairs in bin BINS - 1, after the pseudo-expert) and one
    histogram of the bins. Needs BINS >= num_groups + 2."""
    P: tl.constexpr = T_PAD * S_PAD
    tok = tl.arange(0, T_PAD)
    slot = tl.arange(0, S_PAD)
    pair_ok = (tok < num_tokens)[:, None] & (slot < SLOTS)[None, :]
    e = tl.load(ids_ptr + tok.to(tl.int64)[:, None] * stride_i + slot[None, :], mask=pair_ok, other=0,
                cache_modifier=".cg")
    if ERR_FLAG != 0:
        bad = pair_ok & ((e < 0) | (e >= num_groups))
        e = tl.where(bad, num_groups, e)
        tl.atomic_or(err_ptr, ERR_FLAG, mask=tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0)
    e = tl.where(pair_ok, e, BINS - 1)
    flat_e = tl.reshape(e, [P])
    counts = tl.histogram(flat_e, BINS)
    bins = tl.arange(0, BINS)
    tl.store(offsets_ptr + bins, tl.cumsum(counts, axis=0), mask=bins < num_groups)
    key = tl.reshape(e * P + tok[:, None] * S_PAD + slot[None, :], [P])
    key = tl.sort(key)  # stable by expert: the pair index breaks the ties
    row = tl.arange(0, P)
    pair = key % P
    t = pair // S_PAD
    ok = row < num_tokens * SLOTS  # the valid pairs sort before the padding
    tl.store(sorted_expert_ptr + row, key // P, mask=ok)
    tl.store(row_index_ptr + row, t, mask=ok)
    tl.store(inv_perm_ptr + t * SLOTS + pair % S_PAD, row, mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_dispatch_kernel(
    x_ptr, stride_x,  # (T, H) bf16/fp32, unit column stride
    w_ptr, stride_g,  # (E, H) fp32/bf16 gate, unit column stride
    bias_ptr,  # (E,) fp32 (read if HAS_BIAS)
    ws_ptr,  # fp32 workspace: logits (T, E), then partials (splits, T, E) when SPLIT
    cnt_ptr,  # (>= e_blocks + 1,) int32 zeros
    weights_ptr, stride_w,  # (T, >=k) fp32 out
    ids_ptr, stride_i,  # (T, >=SLOTS) int32 out (columns k..SLOTS-1 preset by the caller)
    token_ids_ptr, tid2eid_ptr, vocab, stride_t,  # hash routing (read if HASH)
    offsets_ptr, sorted_expert_ptr, row_index_ptr, inv_perm_ptr,  # dispatch outputs
    err_ptr,
    num_tokens, num_experts, hidden, num_groups, routed_scaling_factor,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SLOTS: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr,
    T_PAD: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, TB: tl.constexpr, SPLIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr, TBR: tl.constexpr, USE_DOT: tl.constexpr, BT: tl.constexpr, BINS: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, HASH: tl.constexpr,
    FLAG_TOKENS: tl.constexpr, FLAG_TABLE: tl.constexpr, FLAG_IDS: tl.constexpr, PDL: tl.constexpr = False,
    xp_ptr=None, stride_xp=0, PAIRED_X: tl.constexpr = False,  # (T, H) bf16 out: x in the paired order
    PAIRED_GROUPS: tl.constexpr = 1,  # 8-element groups of x each program copies (PAIRED_X)
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    splits = tl.num_programs(1)
    e_blocks = tl.num_programs(0)
    logits_size = num_tokens * num_experts
    if PAIRED_X:
        # the paired copy of x (the expert GEMMs' x), spread over every program so that none is late: program p
        # copies the 8-element groups p, p + P, ... of the (T, H / 8) groups, each group permuted in registers
        # (element 2a + b to position 4b + a) and stored whole
        groups = hidden // 8
        prog = pid_e * splits + pid_s
        gid = prog + tl.arange(0, PAIRED_GROUPS).to(tl.int64) * (e_blocks * splits)
        g_ok = gid < num_tokens * groups
        g_tok = gid // groups
        g_col = (gid % groups) * 8
        e8 = tl.arange(0, 8)
        xg = tl.load(x_ptr + (g_tok * stride_x + g_col)[:, None] + e8[None, :], mask=g_ok[:, None], other=0.0)
        xg = tl.reshape(tl.permute(tl.reshape(xg, [PAIRED_GROUPS, 4, 2]), (0, 2, 1)), [PAIRED_GROUPS, 8])
        tl.store(xp_ptr + (g_tok * stride_xp + g_col)[:, None] + e8[None, :], xg.to(xp_ptr.dtype.element_ty),
                 mask=g_ok[:, None])
    # ---- stage 1: logits (or a partial) of experts [pid_e * BLOCK_E, +BLOCK_E) over this program's H chunk;
    # the gate tile is loaded at once (all its loads in flight), then the tokens in blocks of TB
    ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    ex_ok = ex < num_experts
    hh = pid_s * CHUNK + tl.arange(0, CHUNK)
    h_ok = hh < hidden
    w = tl.load(w_ptr + ex.to(tl.int64)[:, None] * stride_g + hh[None, :], mask=ex_ok[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    if USE_DOT:
        wt = tl.trans(w)
    if SPLIT:
        dest = ws_ptr + logits_size + pid_s.to(tl.int64) * logits_size
    else:
        dest = ws_ptr
    t0 = pid_e * 0
    while t0 < num_tokens:
        tok = t0 + tl.arange(0, TB)
        tok_ok = tok < num_tokens
        xv = tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_x + hh[None, :],
                     mask=tok_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        if USE_DOT:
            acc = tl.dot(xv, wt, input_precision="ieee")
        else:
            acc = tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
        tl.store(dest + tok.to(tl.int64)[:, None] * num_experts + ex[None, :], acc,
                 mask=tok_ok[:, None] & ex_ok[None, :])
        t0 += TB
    # ---- with H splits: the last split of this expert block sums the partials (tree over the split axis, a
    # fixed order) -> logits (T, E)
    tl.debug_barrier()
    if SPLIT:
        ticket = tl.atomic_add(cnt_ptr + pid_e, 1, sem="acq_rel", scope="gpu")
        block_done = ticket == splits - 1
        if block_done:
            sp = tl.arange(0, SPLITS_PAD)
            sp_off = logits_size + sp.to(tl.int64) * logits_size
            t0 = pid_e * 0
            while t0 < num_tokens:
                tok = t0 + tl.arange(0, TBR)
                off = tok.to(tl.int64)[:, None] * num_experts + ex[None, :]
                ok = (tok < num_tokens)[:, None] & ex_ok[None, :]
                parts = tl.load(ws_ptr + sp_off[:, None, None] + off[None, :, :],
                                mask=(sp < splits)[:, None, None] & ok[None, :, :], other=0.0, cache_modifier=".cg")
                tl.store(ws_ptr + off, tl.sum(parts, axis=0), mask=ok)
                t0 += TBR
            tl.store(cnt_ptr + pid_e, 0)
            tl.debug_barrier()
    else:
        block_done = pid_e >= 0
    if block_done:
        final = tl.atomic_add(cnt_ptr + e_blocks, 1, sem="acq_rel", scope="gpu")
        if final == e_blocks - 1:
            # ---- stage 2: route the tokens (blocks of BT), then group the pairs by expert
            t0 = pid_e * 0
            while t0 < num_tokens:
                _finish_tokens(ws_ptr, bias_ptr, weights_ptr, ids_ptr, token_ids_ptr, tid2eid_ptr, err_ptr,
                               num_tokens, num_experts, vocab, stride_t, stride_w, stride_i,
                               routed_scaling_factor, t0, TOP_K, K_PAD, E_PAD, BT, SCORING, HAS_BIAS,
                               NORMALIZE, HASH, FLAG_TOKENS, FLAG_TABLE)
                t0 += BT
            tl.debug_barrier()  # the ids stored above are read back by other threads of this program
            _group_pairs(ids_ptr, stride_i, offsets_ptr, sorted_expert_ptr, row_index_ptr, inv_perm_ptr, err_ptr,
                         num_tokens, num_groups, SLOTS, S_PAD, T_PAD, BINS, FLAG_IDS)
            tl.store(cnt_ptr + e_blocks, 0)


def launch_route_dispatch(hidden_states: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None,
                          top_k: int, scoring_func: str, norm_topk_prob: bool, routed_scaling_factor: float,
                          weights_out: torch.Tensor, ids_out: torch.Tensor, slots: int, num_groups: int,
                          offsets: torch.Tensor, sorted_expert: torch.Tensor, row_index: torch.Tensor,
                          inv_perm: torch.Tensor, counters: torch.Tensor, *, token_ids: torch.Tensor | None = None,
                          tid2eid: torch.Tensor | None = None, error_word: torch.Tensor | None = None,
                          interpreter: bool = False, x_paired_out: torch.Tensor | None = None) -> None:
    """One launch: route T tokens and group their ``T * slots`` pairs (module docstring).

    hidden_states (T >= 1, H) bf16/fp32 and gate_weight (E, H) fp32/bf16, unit column stride; bias (E,) fp32
    or None; weights_out (T, >=k) fp32 / ids_out (T, >=slots) int32, unit column stride (ids columns
    k..slots-1 preset by the caller); offsets (num_groups,) and sorted_expert / row_index / inv_perm
    (>= T*slots,) int32 contiguous; counters from :func:`route_dispatch_counters`; token_ids (T,) int32/int64
    contiguous + tid2eid (V, k) int32 unit column stride: hash routing. error_word: default the device's.
    x_paired_out: None or (>= T, H) bf16, unit column stride, H % 8 == 0: also receives hidden_states in the paired
    order (:func:`megamoe.format.mma_order.to_paired_order`; the expert GEMMs' ``x_order="paired"`` input), a few
    8-element groups per program (each permuted in registers), independent of the program's own work.
    """
    from ..ops import errors

    num_tokens, hidden = hidden_states.shape
    num_experts = gate_weight.shape[0]
    device = hidden_states.device
    programs = INTERPRETER_PROGRAMS if interpreter or not hidden_states.is_cuda else _num_sms(device.index)
    p = plan_route_dispatch(num_tokens, num_experts, hidden, programs)
    if p["e_blocks"] + 1 > counters.shape[0]:
        raise ValueError(f"counters: {p['e_blocks'] + 1} slots needed, got {counters.shape[0]}")
    split = p["splits"] > 1
    ws = torch.empty(((p["splits"] + 1) if split else 1) * num_tokens * num_experts, dtype=torch.float32,
                     device=device)
    word = error_word if error_word is not None else errors.error_word(device)
    hashed = tid2eid is not None
    pdl, launch_pdl = pdl_flags(hidden_states, "route_dispatch")
    _route_dispatch_kernel[(p["e_blocks"], p["splits"])](
        hidden_states, hidden_states.stride(0), gate_weight, gate_weight.stride(0),
        bias if bias is not None else gate_weight, ws, counters,
        weights_out, weights_out.stride(0), ids_out, ids_out.stride(0),
        token_ids if hashed else ids_out, tid2eid if hashed else ids_out,
        tid2eid.shape[0] if hashed else 0, tid2eid.stride(0) if hashed else 0,
        offsets, sorted_expert, row_index, inv_perm, word,
        num_tokens, num_experts, hidden, num_groups, float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), SLOTS=slots, S_PAD=triton.next_power_of_2(slots),
        E_PAD=triton.next_power_of_2(num_experts), T_PAD=p["T_PAD"], BLOCK_E=p["BLOCK_E"], CHUNK=p["CHUNK"],
        TB=p["TB"], SPLIT=split, SPLITS_PAD=p["SPLITS_PAD"], TBR=p["TBR"], USE_DOT=p["USE_DOT"], BT=p["BT"],
        BINS=triton.next_power_of_2(num_groups + 2),
        SCORING=SCORING_CODES[scoring_func], HAS_BIAS=bias is not None and not hashed,
        NORMALIZE=bool(norm_topk_prob), HASH=hashed,
        FLAG_TOKENS=errors.kernel_flag("route", "token_ids") if hashed else 0,
        FLAG_TABLE=errors.kernel_flag("route", "tid2eid") if hashed else 0,
        FLAG_IDS=errors.kernel_flag("dispatch", "topk_ids"), num_warps=p["num_warps"],
        PDL=pdl, launch_pdl=launch_pdl,
        **(dict(xp_ptr=x_paired_out, stride_xp=x_paired_out.stride(0), PAIRED_X=True,
                PAIRED_GROUPS=triton.next_power_of_2(triton.cdiv(num_tokens * (hidden // 8),
                                                                 p["e_blocks"] * p["splits"])))
           if x_paired_out is not None else {}),
    )
