"""MoE router selection in one launch: bias, NaN policy, stable top-k, gather, renormalise, scale.

One kernel, one launcher (:func:`launch_moe_topk`). Input: the float32 scores
(T, E) computed by torch exactly as the reference router computes them (so the
selection keys are bit-identical); this kernel replaces the ~9 small torch ops
that follow (bias add, nan_to_num, stable sort, slice, gather, sum, eps add,
divide, scale, int cast) and writes the ids / weights straight into strided
buffers (e.g. the first k columns of the layer's (T, k+1) buffers with the
fused shared-expert slot).

Selection = the reference's stable descending sort: k times, take the maximum
key among the experts not yet taken and, among equal keys, the lowest index;
NaN keys count as -inf. The key ``score + bias`` is one float32 add, as in
torch, so the selected ids are identical to the reference's. The weights
``score / (sum + 1e-20) * scale`` may differ from torch in the last ulp (the
order of the k-term sum).

Group-limited routing (n_group > 1, DeepSeek-V3 style): each group's key is
the sum of its two largest expert keys (one float32 add, as torch's top-2 sum),
the ``topk_group`` best groups are kept with the same stable rule (ties -> lower
group index) and the experts of the other groups get key -inf before the
expert selection. Handled when E and n_group are powers of two (the op falls
back to torch otherwise).

Hash routing (``HASH``; DeepSeek-V4's first layers): the ids are the token's
row of the ``tid2eid`` (V, k) int32 table instead of a selection; the weights
are the scores gathered at those ids, then the same renormalisation and scale.
A token id outside [0, V) or a row entry outside [0, E) gives ids 0..k-1 and
NaN weights (the reference's invalid-input policy); every load is masked, so
nothing is read out of bounds. Both are flagged in the device error word
(``megamoe/ops/errors.py``: ``route`` ``token_ids`` / ``tid2eid``), one
predicated atomic per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import grid_dependency_prologue, pdl_enabled


@triton.jit
def _keep_top_groups(key, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """(E_PAD,) keys -> the same keys with -inf outside the TOPK_GROUP best groups (E_PAD == E here)."""
    GROUP_SIZE: tl.constexpr = E_PAD // N_GROUP
    grouped = tl.reshape(key, (N_GROUP, GROUP_SIZE))
    members = tl.arange(0, GROUP_SIZE)
    first = tl.max(grouped, axis=1)
    if GROUP_SIZE > 1:
        first_at = tl.min(tl.where(grouped == first[:, None], members[None, :], GROUP_SIZE), axis=1)
        rest = tl.where(members[None, :] == first_at[:, None], float("-inf"), grouped)
        group_key = first + tl.max(rest, axis=1)
    else:
        group_key = first
    group_key = tl.where(group_key != group_key, float("-inf"), group_key)
    groups = tl.arange(0, N_GROUP)
    kept = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        cand = tl.where(kept, float("-inf"), group_key)
        best = tl.max(cand, axis=0)
        pick = tl.min(tl.where((cand == best) & (kept == 0), groups, N_GROUP), axis=0)
        kept = kept | (groups == pick)
    masked = tl.where(kept[:, None], grouped, float("-inf"))
    return tl.reshape(masked, (E_PAD,))


@triton.jit
def _moe_topk_kernel(
    scores_ptr,  # (T, E) fp32
    bias_ptr,  # (E,) fp32 (read if HAS_BIAS)
    weights_ptr,  # (T, >=k) fp32 out, row stride stride_w
    ids_ptr,  # (T, >=k) int32 out, row stride stride_i
    num_experts,
    stride_s,
    stride_w,
    stride_i,
    routed_scaling_factor,
    token_ids_ptr,  # (T,) int32/int64 (read if HASH)
    tid2eid_ptr,  # (V, >=k) int32, row stride stride_t (read if HASH)
    vocab,
    stride_t,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HASH: tl.constexpr,
    err_ptr=None,  # (1,) int32 error word (megamoe/ops/errors.py; used if HASH and a flag is non-zero)
    FLAG_TOKENS: tl.constexpr = 0,
    FLAG_TABLE: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    grid_dependency_prologue(PDL)  # first: before any global access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    keep = slots < TOP_K
    if HASH:
        tok = tl.load(token_ids_ptr + token).to(tl.int64)
        tok_ok = (tok >= 0) & (tok < vocab)
        row = tl.load(tid2eid_ptr + tl.where(tok_ok, tok, 0) * stride_t + slots, mask=keep & tok_ok, other=0)
        bad_entry = tl.max(tl.where(keep & ((row < 0) | (row >= num_experts)), 1, 0), axis=0)
        ok = tok_ok & (bad_entry == 0)
        if FLAG_TOKENS | FLAG_TABLE != 0:  # 0: guard compiled out (MEGAMOE_DEVICE_GUARD=0)
            code = (~tok_ok).to(tl.int32) * FLAG_TOKENS | (tok_ok & (bad_entry != 0)).to(tl.int32) * FLAG_TABLE
            tl.atomic_or(err_ptr, code, mask=code != 0)
        chosen_i = tl.where(ok, row, slots).to(tl.int32)
        chosen_w = tl.load(scores_ptr + token * stride_s + chosen_i, mask=keep, other=0.0)
    else:
        cols = tl.arange(0, E_PAD)
        valid = cols < num_experts
        scores = tl.load(scores_ptr + token * stride_s + cols, mask=valid, other=0.0)
        key = scores
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + cols, mask=valid, other=0.0)
        key = tl.where(key != key, float("-inf"), key)
        if N_GROUP > 1:
            key = _keep_top_groups(key, E_PAD, N_GROUP, TOPK_GROUP)
        taken = cols >= num_experts
        chosen_w = tl.zeros((K_PAD,), dtype=tl.float32)
        chosen_i = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            cand = tl.where(taken, float("-inf"), key)
            best = tl.max(cand, axis=0)
            idx = tl.min(tl.where((cand == best) & (taken == 0), cols, E_PAD), axis=0)
            hit = cols == idx
            taken = taken | hit
            w = tl.sum(tl.where(hit, scores, 0.0), axis=0)
            chosen_w = tl.where(slots == j, w, chosen_w)
            chosen_i = tl.where(slots == j, idx, chosen_i)
    if NORMALIZE:
        total = tl.sum(chosen_w, axis=0)
        chosen_w = chosen_w / (total + 1e-20)
    chosen_w = chosen_w * routed_scaling_factor
    if HASH:
        chosen_w = tl.where(ok, chosen_w, float("nan"))
    tl.store(weights_ptr + token * stride_w + slots, chosen_w, mask=keep)
    tl.store(ids_ptr + token * stride_i + slots, chosen_i, mask=keep)


def supports_groups(num_experts: int, n_group: int) -> bool:
    """Whether the kernel handles group-limited routing for these (host-known) sizes."""
    def power_of_two(n):
        return n >= 1 and n & (n - 1) == 0
    return n_group == 1 or (power_of_two(num_experts) and power_of_two(n_group) and n_group <= num_experts)


def launch_moe_topk(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, norm_topk_prob: bool,
                    routed_scaling_factor: float, weights_out: torch.Tensor, ids_out: torch.Tensor,
                    n_group: int = 1, topk_group: int = 1, token_ids: torch.Tensor | None = None,
                    tid2eid: torch.Tensor | None = None, error_word: torch.Tensor | None = None) -> None:
    """scores (T, E) fp32 unit column stride; bias (E,) fp32 or None; outputs (T, >=k) fp32 / int32, unit column stride.

    n_group / topk_group: group-limited selection (needs ``supports_groups(E, n_group)``).
    token_ids (T,) int32/int64 contiguous + tid2eid (V, k) int32 unit column stride: hash routing (bias and
    groups unused). error_word: the (1,) int32 word an out-of-range token id / table entry flags (hash routing;
    default: the device's, ``megamoe.ops.errors``).
    """
    from ..ops import errors

    num_tokens, num_experts = scores.shape
    hashed = tid2eid is not None
    if hashed:
        n_group = topk_group = 1
    if not supports_groups(num_experts, n_group):
        raise ValueError(f"n_group: group-limited routing needs E and n_group powers of two, got E={num_experts}, "
                         f"n_group={n_group}")
    if num_tokens == 0:
        return
    pdl = pdl_enabled(scores)
    _moe_topk_kernel[(num_tokens,)](
        scores, bias if bias is not None else scores, weights_out, ids_out, num_experts,
        scores.stride(0), weights_out.stride(0), ids_out.stride(0), float(routed_scaling_factor),
        token_ids if hashed else scores, tid2eid if hashed else ids_out,
        tid2eid.shape[0] if hashed else 0, tid2eid.stride(0) if hashed else 0,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        HAS_BIAS=bias is not None and not hashed, NORMALIZE=bool(norm_topk_prob), N_GROUP=n_group,
        TOPK_GROUP=topk_group if n_group > 1 else 1, HASH=hashed,
        err_ptr=(error_word if error_word is not None else errors.error_word(scores.device)) if hashed else ids_out,
        FLAG_TOKENS=errors.kernel_flag("route", "token_ids") if hashed else 0,
        FLAG_TABLE=errors.kernel_flag("route", "tid2eid") if hashed else 0, num_warps=1 if hashed else 4,
        PDL=pdl, launch_pdl=pdl,
    )
