"""MoE routing, dispatch and combine ops (sync-free, CUDA-graph capturable).

* :func:`route` -- DeepSeek-V3/V4 router; validation + the single routing
  definition of ``megamoe/reference/moe.py`` (torch ops on the device), so the
  fast path and the reference route identically (ties: lower expert index).
* :func:`dispatch` -- stable sort of the T*k (token, slot) pairs by expert on
  the device: ``expert_offsets`` (E,) int32 via ``searchsorted`` (no
  ``bincount``, which syncs), the permutation, the GEMM ``row_index`` (token of
  each sorted row) and ``inv_perm`` (sorted row of each pair) for the combine.
* :func:`combine` -- ``out[t] = shared[t] + sum_j w[t, j] * y[inv_perm[t*k+j]]``
  in float32, one bf16 rounding; Triton kernel (``megamoe/kernels/moe_combine.py``)
  on CUDA / under the interpreter, torch ops otherwise. A gather, no atomics:
  deterministic.

None of these read device values on the host. Buffers may be passed in
(``out=``/``buffers=``) to avoid per-call allocations.
"""
from __future__ import annotations

import math

import torch

from ..format.mma_order import to_paired_order
from ..reference import moe as _reference
from ._dispatch import interpreter_enabled, use_triton
from ._validate import check_bool, check_int, check_vector


def _check_tensor(t, name: str, dtypes: tuple, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(t.shape)}")


def _router_kernel_supports(num_experts: int, n_group: int) -> bool:
    from ..kernels.moe_router import supports_groups

    return supports_groups(num_experts, n_group)


def _check_route_out(out, num_tokens: int, top_k: int, device) -> None:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a (weights, ids) pair of tensors, got {type(out).__name__}")
    for name, t, dtype in (("out[0] (weights)", out[0], torch.float32), ("out[1] (ids)", out[1], torch.int32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] < num_tokens or t.shape[1] < top_k:
            raise ValueError(f"{name}: expected shape (>= {num_tokens}, >= {top_k}) (tokens, top_k), got "
                             f"{tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: expected unit column stride, got strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_tid2eid(tid2eid, num_experts: int, top_k: int, vocab_size: int | None = None) -> None:
    """Full validation of a hash-routing table, values included (reads it on the host: load time only).

    tid2eid: (V, top_k) int32 (V = vocab_size when given) with every entry in [0, num_experts).
    num_experts, top_k: ints >= 1; vocab_size: None or an int >= 1.
    """
    check_int(num_experts, "num_experts", 1)
    check_int(top_k, "top_k", 1)
    if vocab_size is not None:
        check_int(vocab_size, "vocab_size", 1)
    _check_tensor(tid2eid, "tid2eid", (torch.int32,), 2)
    if tid2eid.shape[1] != top_k or (vocab_size is not None and tid2eid.shape[0] != vocab_size):
        raise ValueError(f"tid2eid: expected shape ({vocab_size if vocab_size is not None else 'vocab'}, {top_k}) "
                         f"(vocab, top_k), got {tuple(tid2eid.shape)}")
    if tid2eid.shape[0] == 0:
        raise ValueError("tid2eid: expected at least one row (vocab >= 1)")
    lo, hi = int(tid2eid.min()), int(tid2eid.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"tid2eid: expected expert ids in [0, {num_experts}), got values in [{lo}, {hi}]")


def _validate_route_args(hidden_states, gate_weight, correction_bias, top_k, scoring_func, n_group, topk_group,
                         norm_topk_prob, routed_scaling_factor, out, token_ids, tid2eid) -> None:
    """route()'s argument checks (shapes, dtypes, devices, options; no device values read)."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    _check_tensor(hidden_states, "hidden_states", floats, 2)
    _check_tensor(gate_weight, "gate_weight", floats, 2)
    num_experts, hidden = gate_weight.shape
    num_tokens = hidden_states.shape[0]
    device = hidden_states.device
    if hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states: expected {hidden} columns (gate_weight's H), got {hidden_states.shape[1]}")
    if gate_weight.device != device:
        raise ValueError(f"gate_weight: expected device {device}, got {gate_weight.device}")
    if correction_bias is not None:
        _check_tensor(correction_bias, "correction_bias", (torch.float32,), 1)
        if correction_bias.shape[0] != num_experts or correction_bias.device != device:
            raise ValueError(f"correction_bias: expected ({num_experts},) on {device}, got "
                             f"{tuple(correction_bias.shape)} on {correction_bias.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in 1..{num_experts}, got {top_k!r}")
    check_int(n_group, "n_group")
    check_int(topk_group, "topk_group")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group/topk_group: need n_group | E={num_experts} and 1 <= topk_group <= n_group, "
                         f"got {n_group}/{topk_group}")
    if n_group > 1 and topk_group * (num_experts // n_group) < top_k:
        raise ValueError(f"topk_group: {topk_group} groups of {num_experts // n_group} experts hold fewer than "
                         f"top_k={top_k} experts")
    check_bool(norm_topk_prob, "norm_topk_prob")
    if scoring_func not in ("sigmoid", "softmax", "sqrtsoftplus"):
        raise ValueError(f"scoring_func: expected 'sigmoid', 'softmax' or 'sqrtsoftplus', got {scoring_func!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite number, got {routed_scaling_factor!r}")
    hashed = tid2eid is not None
    if hashed:
        _check_tensor(tid2eid, "tid2eid", (torch.int32,), 2)
        if tid2eid.shape[1] != top_k or tid2eid.shape[0] < 1:
            raise ValueError(f"tid2eid: expected shape (vocab >= 1, top_k={top_k}), got {tuple(tid2eid.shape)}")
        if tid2eid.device != device:
            raise ValueError(f"tid2eid: expected device {device}, got {tid2eid.device}")
        if token_ids is None:
            raise ValueError("token_ids: hash routing (tid2eid given) needs the (T,) token ids")
        _check_tensor(token_ids, "token_ids", (torch.int32, torch.int64), 1)
        if token_ids.shape[0] != num_tokens or token_ids.device != device:
            raise ValueError(f"token_ids: expected ({num_tokens},) on {device}, got {tuple(token_ids.shape)} on "
                             f"{token_ids.device}")
        if correction_bias is not None:
            raise ValueError("correction_bias: hash-routed layers use no correction bias; pass None")
    elif token_ids is not None:
        raise ValueError("token_ids: only used with tid2eid (hash routing); got token_ids without a table")
    if out is not None:
        _check_route_out(out, num_tokens, top_k, device)


def route(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    backend: str = "torch",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: (T, H) hidden states -> (topk_weights (T, k) fp32, topk_ids (T, k) int32).

    backend: "torch" (the reference's ops) or "triton": the same torch scores,
    then one kernel (``megamoe/kernels/moe_router.py``) for bias, NaN policy,
    stable top-k, gather, renormalisation and scaling -- identical ids, weights
    equal up to the last ulp; group-limited routing too when E and n_group are
    powers of two. From ``ROUTER_TC_MIN_TOKENS`` bf16 tokens the "triton"
    backend's logits come from the tensor-core kernel
    (``megamoe/kernels/router_logits.py``): another fp32 summation order, so its
    ids follow the routing guarantee of :func:`route_dispatch` instead (equal
    to the torch backend's except at near-ties within the float32 bound).
    "triton" falls back to "torch" otherwise, or when the tensors do not take
    the Triton path.
    out: optional ``(weights (>=T, >=k) fp32, ids (>=T, >=k) int32)`` buffers
    with unit column stride on the same device, written in place on both
    backends; their first T rows / k columns are returned.

    gate_weight: (E, H) bf16/fp32 on the same device; correction_bias: None or
    (E,) fp32 (``e_score_correction_bias``, selection only). Semantics, tie-break
    and NaN policy: ``megamoe/reference/moe.py``.

    Hash routing (DeepSeek-V4's first ``num_hash_layers`` layers): pass
    ``tid2eid`` (V, k) int32 and ``token_ids`` (T,) int32/int64 on the same
    device; ids = ``tid2eid[token_ids]``, weights = the scores at those ids
    (renormalised with norm_topk_prob, times routed_scaling_factor).
    correction_bias must then be None; n_group / topk_group do not apply.
    Only shapes and dtypes are checked here (sync-free): validate the table's
    values once with :func:`check_tid2eid`; out-of-range token ids or entries
    follow the reference's invalid-input policy (ids 0..k-1, NaN weights) and
    are flagged in the device's error word (``megamoe/ops/errors.py``: a token
    id outside ``[0, V)``: ``("route", "token_ids")``; an entry outside
    ``[0, E)`` of a valid token's row: ``("route", "tid2eid")``), both backends.
    """
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    _validate_route_args(hidden_states, gate_weight, correction_bias, top_k, scoring_func, n_group, topk_group,
                         norm_topk_prob, routed_scaling_factor, out, token_ids, tid2eid)
    num_experts, num_tokens, device = gate_weight.shape[0], hidden_states.shape[0], hidden_states.device
    hashed = tid2eid is not None
    if backend == "triton" and use_triton(hidden_states) and (hashed or _router_kernel_supports(num_experts, n_group)):
        from ..kernels.moe_router import launch_moe_topk

        scores = _router_scores(hidden_states, gate_weight, scoring_func)
        if out is None:
            out = (torch.empty((num_tokens, top_k), dtype=torch.float32, device=device),
                   torch.empty((num_tokens, top_k), dtype=torch.int32, device=device))
        weights, ids = out[0][:num_tokens], out[1][:num_tokens]
        if hashed:
            launch_moe_topk(scores, None, top_k, norm_topk_prob, routed_scaling_factor, weights, ids,
                            token_ids=token_ids.contiguous(),
                            tid2eid=tid2eid if tid2eid.stride(1) == 1 else tid2eid.contiguous())
        else:
            launch_moe_topk(scores, None if correction_bias is None else correction_bias.contiguous(), top_k,
                            norm_topk_prob, routed_scaling_factor, weights, ids, n_group=n_group, topk_group=topk_group)
        return weights[:, :top_k], ids[:, :top_k]
    if hashed:
        _record_hash_errors(tid2eid, token_ids, num_experts)
        result = _reference.hash_route(
            hidden_states, gate_weight, tid2eid, token_ids, scoring_func=scoring_func,
            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
        )
    else:
        result = _reference.route(
            hidden_states, gate_weight, correction_bias, top_k=top_k, scoring_func=scoring_func,
            n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
        )
    if out is not None:  # the buffers' views, as the Triton path returns them
        out[0][:num_tokens, :top_k].copy_(result[0])
        out[1][:num_tokens, :top_k].copy_(result[1])
        return out[0][:num_tokens, :top_k], out[1][:num_tokens, :top_k]
    return result


#: "auto" dispatch: the Triton kernels (megamoe/kernels/moe_dispatch.py) up to this many pairs, the torch sort path
#: above (no bound: the blocked kernels take any size). H100 (gpu_check_v23/h/bench_dispatch.md, 257 groups): the
#: one-program kernel vs torch 5.8 vs 30.1 us at 7 pairs, 8.7 vs 53.4 at 448, 24.6 vs 56.5 at 1792, 208 vs 81 at
#: 7168; the blocked kernels 3.7-5.0x faster than torch from 1792 pairs (gpu_check_v28; NOTES_moe_decode.md "Blocked
#: dispatch").
DISPATCH_KERNEL_MAX_PAIRS = 1 << 62
#: The largest pair count the one-program sort kernel takes (all keys of one program); above, ``backend="triton"`` runs
#: the blocked kernels (two launches of DISPATCH_BLOCK pairs per program). H100 (gpu_check_v28/bench_dispatch.md,
#: graph replay): one program 8.6 / 13.8 / 24.4 / 206.8 us at 448 / 896 / 1792 / 7168 pairs; blocked 15.6 / 16.1 /
#: 21.4 us at 1792 / 7168 / 114688 (torch 56-96 us).
DISPATCH_SORT_MAX_PAIRS = 1024

#: From this many tokens the "triton" route backend computes the logits on the tensor cores
#: (``megamoe/kernels/router_logits.py``: bf16 x, exact products, promotion of each 64-K chunk into the fp32
#: accumulator) instead of torch's ``x.float() @ gate.float().T`` (an fp32 copy of x and an SGEMM). Its ids obey the
#: routing guarantee of :func:`route_dispatch`, not bit equality with the torch backend. H100 (route op, top-6, graph
#: replay; gpu_check_v23/bench_router_logits.md): V4-Flash 64 / 256 / 1024 / 4096 tokens 0.93x / 1.30x / 2.26x / 4.25x
#: (269 -> 63 us at 4096), V4-Pro 4096 5.74x (579 -> 101 us). With the small-T config (gpu_check_v23/h): 16 / 32 /
#: 64 / 128 tokens 1.31x / 1.17x / 1.18x / 1.39x (V4-Flash), 1.20x / 1.19x / 1.54x / 1.49x (V4-Pro), so from 16 (below,
#: decode takes the fused route launch anyway).
ROUTER_TC_MIN_TOKENS = 16


def _router_scores(hidden_states: torch.Tensor, gate_weight: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Steps 1-2 of the router for the "triton" backend: the reference's float32 scores, with the logits from the
    tensor-core kernel for bf16 activations from :data:`ROUTER_TC_MIN_TOKENS` tokens (host shapes only)."""
    if hidden_states.dtype != torch.bfloat16 or hidden_states.shape[0] < ROUTER_TC_MIN_TOKENS:
        return _reference.router_scores(hidden_states, gate_weight, scoring_func)
    from ..kernels.router_logits import launch_router_logits

    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    w = gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous()
    logits = launch_router_logits(x, w, interpreter=not x.is_cuda)
    return _reference.score_function(logits, scoring_func)


#: The fused decode route + dispatch launch is used up to this many tokens (host decision on the shape); above
#: it the gate GEMM + scoring + top-k kernel + dispatch path (see :func:`route_dispatch`). H100 graph replay,
#: kernel v2 (benchmarks/results/gpu_check_v10/route_v2.md), unfused vs fused: V4-Flash 1 / 2 / 4 / 8 / 16 / 64
#: tokens 25.4 / 32.1 / 32.0 / 41.6 / 47.3 / 72.3 vs 14.1 / 14.6 / 15.3 / 26.2 / 41.0 / 110.3 us; V4-Pro 29.4 /
#: 47.2 / 47.2 / 47.7 / 53.1 / 94.2 vs 17.5 / 20.7 / 25.2 / 47.1 / 79.6 / 227.0 us: faster up to 8 tokens.
#: 16 since 2026-11-26 (one program per expert up to 32 tokens, gpu_check_v23/route_split/route_split64.md): fused vs
#: unfused V4-Flash 8 / 16 / 32 tokens 17.6 / 25.3 / 40.4 vs 44.1 / 49.9 / 53.6 us, V4-Pro 33.0 / 54.2 / 96.7 vs 54.8 /
#: 59.8 / 67.9 (Pro loses at 32).
FUSED_ROUTE_MAX_TOKENS = 16


def route_dispatch(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    num_groups: int | None = None,
    slots: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    buffers: dict | None = None,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    backend: str = "triton",
    dispatch_backend: str = "auto",
    x_paired_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Router + dispatch: ``(topk_weights (T, k) fp32, topk_ids (T, k) int32, dispatch dict)``.

    Arguments as :func:`route` (routing) and :func:`dispatch` (the dict: ``expert_offsets`` (num_groups,),
    ``sorted_expert`` / ``row_index`` / ``inv_perm`` (T*slots,) int32, same format). num_groups: the dispatch's
    expert groups (default E; E+1 with a fused shared expert). slots: pairs per token grouped (default k):
    with ``slots > k`` the columns ``k..slots-1`` of ``out[1]`` (then required, with >= slots columns) hold
    caller-preset ids (e.g. the fused shared expert's id E) that are grouped too. buffers: as
    :func:`dispatch`'s (``expert_offsets`` exactly num_groups elements).

    Paths (host decision on shapes only): with ``backend="triton"``, the tensors on the Triton path,
    ``1 <= T <= FUSED_ROUTE_MAX_TOKENS`` and ``n_group == 1``, ONE launch of
    ``megamoe/kernels/moe_route_dispatch.py`` (gate GEMV in fp32, scoring, bias, top-k, renormalisation,
    scaling, grouping; hash routing with ``tid2eid``); otherwise :func:`route` then :func:`dispatch`
    (``dispatch_backend``: "auto" = the Triton dispatch kernels up to ``DISPATCH_KERNEL_MAX_PAIRS`` pairs, torch
    above).

    **Routing guarantee** of the fused path (it sums the float32 logits in its own fixed order, so its keys
    may differ from the torch path's in the last bits): its ids equal those of the float64 evaluation of the
    reference's routing (``megamoe/reference/moe.py``: same scoring, bias, NaN policy, stable tie-break)
    except for a token whose k-th and (k+1)-th selection keys -- or two neighbouring keys among its first
    k+1, for the order of its ids -- agree within the float32 bound of
    :func:`megamoe.reference.moe.routing_key_bounds` (logit error ``<= gamma_H * sum_h |x_h| |w_eh|``,
    mapped through the score function, plus a few ulps for scoring and the bias add); at such a near-tie
    either choice is a correct float32 routing. Exact ties (equal float32 keys) go to the lower expert index
    on every path. Weights: the float64 ones within the same propagated bound (plus a few ulps for the
    renormalisation). The dispatch structures are exactly those of :func:`dispatch` on the returned ids.
    NaN policy (both paths): a NaN logit gives a NaN score and a -inf key (never chosen while k finite keys
    exist); a token with every logit NaN (e.g. a NaN hidden state) goes to experts 0..k-1 with NaN
    weights; softmax: one NaN logit makes the token's every score NaN. The result is the same on both
    paths. Results are deterministic (the same bits on every run, eager or CUDA-graph replay). Hash routing
    flags as :func:`route`; an id outside ``[0, num_groups)`` (only possible in caller-preset columns) flags
    as :func:`dispatch`.
    T = 0: empty outputs, ``expert_offsets`` all zero.
    x_paired_out: None or a contiguous (>= T, H) bf16 buffer on the device, H % 8 == 0: rows [0, T) also receive
    ``hidden_states`` in the paired order (:func:`megamoe.format.mma_order.to_paired_order`), the expert GEMMs'
    ``x_order="paired"`` input; the fused launch spreads the copy over its programs, other paths make a torch copy.
    """
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    if x_paired_out is not None:
        if not isinstance(x_paired_out, torch.Tensor):
            raise TypeError(f"x_paired_out: expected a tensor or None, got {type(x_paired_out).__name__}")
        if (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2
                and (x_paired_out.dim() != 2 or x_paired_out.dtype != torch.bfloat16
                     or x_paired_out.device != hidden_states.device or not x_paired_out.is_contiguous()
                     or x_paired_out.shape[1] != hidden_states.shape[1] or hidden_states.shape[1] % 8
                     or x_paired_out.shape[0] < hidden_states.shape[0])):
            raise ValueError(f"x_paired_out: expected a contiguous bf16 (>= T, H) buffer "
                             f"on {hidden_states.device} with "
                             f"H % 8 == 0 for hidden states {tuple(hidden_states.shape)}, got "
                             f"{x_paired_out.dtype} {tuple(x_paired_out.shape)} on {x_paired_out.device}")
    _validate_route_args(hidden_states, gate_weight, correction_bias, top_k, scoring_func, n_group, topk_group,
                         norm_topk_prob, routed_scaling_factor, out, token_ids, tid2eid)
    num_experts = gate_weight.shape[0]
    num_groups = num_experts if num_groups is None else num_groups
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < num_experts:
        raise ValueError(f"num_groups: expected an int >= E={num_experts}, got {num_groups!r}")
    slots = top_k if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not isinstance(top_k, int) or slots < top_k:
        raise ValueError(f"slots: expected an int >= top_k={top_k!r}, got {slots!r}")
    if slots > top_k and out is None:
        raise ValueError(f"out: slots={slots} > top_k={top_k} needs the (weights, ids) buffers with the preset ids")
    if dispatch_backend not in ("auto", "torch", "triton"):
        raise ValueError(f"dispatch_backend: expected 'auto', 'torch' or 'triton', got {dispatch_backend!r}")
    num_tokens = hidden_states.shape[0]
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2 or not isinstance(out[1], torch.Tensor)
                            or out[1].dim() != 2 or out[1].shape[1] < slots):
        raise ValueError(f"out: expected (weights, ids) buffers with ids of >= {slots} columns (slots)")
    # the ids are int32 on every path: int32 sorted experts / experts table (before route() writes ``out``)
    b = _check_dispatch_buffers(buffers, num_tokens * slots, num_groups, hidden_states.device, torch.int32,
                                torch.int32)
    fused = (backend == "triton" and use_triton(hidden_states)
             and 1 <= num_tokens <= FUSED_ROUTE_MAX_TOKENS and n_group == 1)
    if not fused or num_tokens == 0:
        weights, ids = route(hidden_states, gate_weight, correction_bias, top_k=top_k, scoring_func=scoring_func,
                             n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                             routed_scaling_factor=routed_scaling_factor, backend=backend, out=out,
                             token_ids=token_ids, tid2eid=tid2eid)
        pair_ids = out[1][:num_tokens, :slots] if slots > top_k else ids
        pairs = num_tokens * slots
        if dispatch_backend == "auto":
            dispatch_backend = "triton" if pairs <= DISPATCH_KERNEL_MAX_PAIRS else "torch"
        d = dispatch(pair_ids, num_groups, buffers=buffers, backend=dispatch_backend)
        if num_tokens == 0:
            d["expert_offsets"].zero_()
        if x_paired_out is not None and num_tokens:
            to_paired_order(hidden_states, out=x_paired_out[:num_tokens])
        return weights, ids, d
    from ..kernels.moe_route_dispatch import launch_route_dispatch, route_dispatch_counters

    counters = route_dispatch_counters(hidden_states.device)
    if counters is None:  # first use inside a graph capture: the unfused path (same ids up to the guarantee)
        return route_dispatch(hidden_states, gate_weight, correction_bias, top_k=top_k, scoring_func=scoring_func,
                              norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                              num_groups=num_groups, slots=slots, out=out, buffers=buffers, token_ids=token_ids,
                              tid2eid=tid2eid, backend="torch", dispatch_backend=dispatch_backend,
                              x_paired_out=x_paired_out)
    device = hidden_states.device
    if out is None:
        out = (torch.empty((num_tokens, top_k), dtype=torch.float32, device=device),
               torch.empty((num_tokens, top_k), dtype=torch.int32, device=device))
    weights, ids = out[0][:num_tokens], out[1][:num_tokens]
    pairs = num_tokens * slots

    def buf(name, n):  # checked by _check_dispatch_buffers
        return b[name][:n] if name in b else torch.empty(n, dtype=torch.int32, device=device)

    d = {"expert_offsets": buf("expert_offsets", num_groups), "sorted_expert": buf("sorted_expert", pairs),
         "row_index": buf("row_index", pairs), "inv_perm": buf("inv_perm", pairs)}
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    gate = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    hashed = tid2eid is not None
    launch_route_dispatch(
        x, gate, None if correction_bias is None else correction_bias.contiguous(), top_k, scoring_func,
        norm_topk_prob, routed_scaling_factor, weights, ids,
        slots, num_groups, d["expert_offsets"], d["sorted_expert"], d["row_index"], d["inv_perm"], counters,
        token_ids=token_ids.contiguous() if hashed else None,
        tid2eid=(tid2eid if tid2eid.stride(1) == 1 else tid2eid.contiguous()) if hashed else None,
        interpreter=interpreter_enabled() and not x.is_cuda,
        x_paired_out=x_paired_out,
    )
    return weights[:, :top_k], ids[:, :top_k], d


def _record_hash_errors(tid2eid: torch.Tensor, token_ids: torch.Tensor, num_experts: int) -> None:
    """Torch path: the router kernel's hash-routing flags (megamoe/ops/errors.py), same rules, device ops."""
    from . import errors

    vocab = tid2eid.shape[0]
    tok = token_ids.long()
    tok_ok = (tok >= 0) & (tok < vocab)
    rows = tid2eid.index_select(0, tok.clamp(0, vocab - 1))
    bad_row = ((rows < 0) | (rows >= num_experts)).any(dim=1)
    word = errors.error_word(token_ids.device)
    errors.record(word, errors.flag("route", "token_ids"), ~tok_ok)
    errors.record(word, errors.flag("route", "tid2eid"), tok_ok & bad_row)


def dispatch(topk_ids: torch.Tensor, num_experts: int, *, buffers: dict | None = None,
             backend: str = "torch") -> dict:
    """Group the (token, slot) pairs by expert on the device, without host syncs.

    topk_ids: (T, k) int32/int64; num_experts: an int E >= 1. Returns a dict of device tensors:
    ``expert_offsets`` (E,) int32 cumulative row ends; ``sorted_expert`` (T*k,)
    expert of each sorted row (non-decreasing); ``row_index`` (T*k,) int32 token
    of each sorted row (pairs of one expert keep token order: a stable sort);
    ``inv_perm`` (T*k,) int32 sorted row of pair ``t*k + j``.
    buffers: optional preallocated tensors with the same keys, each with at
    least T*k elements (``expert_offsets``: exactly E), plus ``arange`` (>= T*k
    int32 0..), ``experts`` (E,) of topk_ids' integer dtype 0..E-1 and ``perm``
    (>= T*k int64 scratch of the torch sort). Every buffer given must be a
    contiguous 1-D tensor on topk_ids' device, int32 (``sorted_expert``: int32
    on the kernel path, topk_ids' dtype on the torch path), else ValueError /
    TypeError before anything is written.
    backend: "torch" (stable radix sort + searchsorted + scatter; any size) or
    "triton" (``megamoe/kernels/moe_dispatch.py``: one single-program sort up to
    ``DISPATCH_SORT_MAX_PAIRS`` pairs, two blocked launches above; int32 ids and
    ``sorted_expert``; identical values). "triton" on a CPU tensor without
    ``TRITON_INTERPRET=1`` falls back to "torch".

    An id outside ``[0, E)`` drops its pair on both backends: the pair is grouped
    as a pseudo-expert E after every real expert (``sorted_expert`` = E), i.e. into
    the padding rows past ``expert_offsets[E-1]`` that the grouped GEMM writes as
    zeros, so the combine adds ``w * 0``; the ``("dispatch", "topk_ids")`` bit of
    the device's error word is set (``megamoe/ops/errors.py``).
    """
    _check_tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), 2)
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    check_int(num_experts, "num_experts", 1)
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    kernel = backend == "triton" and use_triton(topk_ids) and pairs > 0
    # the kernel writes int32 sorted experts; the torch sort keeps the ids' dtype
    b = _check_dispatch_buffers(buffers, pairs, num_experts, device, torch.int32 if kernel else topk_ids.dtype,
                                topk_ids.dtype)
    if kernel:
        return _dispatch_triton(flat, top_k, num_experts, pairs, b)
    from . import errors

    invalid = (flat < 0) | (flat >= num_experts)
    errors.record(errors.error_word(device), errors.flag("dispatch", "topk_ids"), invalid)
    flat = torch.where(invalid, num_experts, flat)  # dropped pairs: pseudo-expert E, sorted last
    if "sorted_expert" in b or "perm" in b:  # perm: int64 scratch, allocated when not given
        sorted_expert = b["sorted_expert"][:pairs] if "sorted_expert" in b else torch.empty(
            pairs, dtype=flat.dtype, device=device)
        perm = b["perm"][:pairs] if "perm" in b else torch.empty(pairs, dtype=torch.int64, device=device)
        torch.sort(flat, stable=True, out=(sorted_expert, perm))
    else:
        sorted_expert, perm = torch.sort(flat, stable=True)
    experts = b.get("experts")
    if experts is None:
        experts = torch.arange(num_experts, dtype=flat.dtype, device=device)
    offsets = b.get("expert_offsets")
    if offsets is None:
        offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    torch.searchsorted(sorted_expert, experts, right=True, out_int32=True, out=offsets)
    row_index = b["row_index"][:pairs] if "row_index" in b else torch.empty(pairs, dtype=torch.int32, device=device)
    torch.floor_divide(perm, top_k, out=row_index)  # perm[r] = pair t*k + j of sorted row r -> token t
    inv_perm = b["inv_perm"][:pairs] if "inv_perm" in b else torch.empty(pairs, dtype=torch.int32, device=device)
    arange = b["arange"][:pairs] if "arange" in b else torch.arange(pairs, dtype=torch.int32, device=device)
    inv_perm.scatter_(0, perm, arange)
    return {
        "expert_offsets": offsets,
        "sorted_expert": sorted_expert,
        "row_index": row_index,
        "inv_perm": inv_perm,
    }


def _check_dispatch_buffers(buffers, pairs: int, num_groups: int, device, sorted_dtype: torch.dtype,
                            ids_dtype: torch.dtype) -> dict:
    """dispatch()'s ``buffers`` (None or a dict): every tensor given is a contiguous 1-D tensor on ``device``:
    ``sorted_expert`` (``sorted_dtype``), ``row_index`` / ``inv_perm`` / ``arange`` (int32) and ``perm`` (int64)
    of >= ``pairs`` elements, ``expert_offsets`` int32 and ``experts`` (``ids_dtype``) of exactly ``num_groups``.
    Host metadata only. Returns the dict ({} for None)."""
    if buffers is None:
        return {}
    if not isinstance(buffers, dict):
        raise TypeError(f"buffers: expected None or a dict of tensors, got {type(buffers).__name__}")
    specs = {"sorted_expert": (sorted_dtype, pairs, None), "row_index": (torch.int32, pairs, None),
             "inv_perm": (torch.int32, pairs, None), "perm": (torch.int64, pairs, None),
             "arange": (torch.int32, pairs, None), "expert_offsets": (torch.int32, None, num_groups),
             "experts": (ids_dtype, None, num_groups)}
    for name, (dtype, at_least, exactly) in specs.items():
        if name in buffers:
            check_vector(buffers[name], f"buffers[{name!r}]", dtype, device, at_least=at_least, exactly=exactly)
    return buffers


def _dispatch_triton(flat: torch.Tensor, top_k: int, num_experts: int, pairs: int, b: dict) -> dict:
    from ..kernels.moe_dispatch import launch_moe_dispatch, launch_moe_dispatch_blocked

    device = flat.device

    def buf(name, n):
        return b[name][:n] if name in b else torch.empty(n, dtype=torch.int32, device=device)

    if flat.dtype == torch.int32:
        ids = flat.contiguous()
    else:  # int64: clamp first, so that an id beyond int32 stays out of range (dropped, flagged) instead of wrapping
        ids = flat.clamp(-1, num_experts).to(torch.int32).contiguous()
    offsets = b["expert_offsets"] if "expert_offsets" in b else torch.empty(num_experts, dtype=torch.int32,
                                                                            device=device)
    out = {"expert_offsets": offsets, "sorted_expert": buf("sorted_expert", pairs),
           "row_index": buf("row_index", pairs), "inv_perm": buf("inv_perm", pairs)}
    # the one-program sort holds every pair at once; above DISPATCH_SORT_MAX_PAIRS the blocked kernels (same outputs)
    launch = launch_moe_dispatch if pairs <= DISPATCH_SORT_MAX_PAIRS else launch_moe_dispatch_blocked
    launch(ids, top_k, num_experts, offsets, out["sorted_expert"], out["row_index"], out["inv_perm"])
    return out


def combine(
    expert_out: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted gather-sum back to token order (+ the shared expert's output).

    expert_out: (R >= T*k, H) bf16 rows sorted by expert. inv_perm: (T*k,)
    int32, sorted row of pair ``t*k + j``. topk_weights: (T, k) fp32.
    shared: None or (T, H) bf16. out: optional (T, H) bf16 buffer.
    Returns (T, H) bf16: ``shared[t] + sum_j w[t, j] * expert_out[inv_perm[t*k+j]]``
    in float32 (shared first, then j ascending), rounded once. A pair whose
    ``inv_perm`` lies outside ``[0, R)`` is dropped (adds ``0 * 0``) and sets the
    ``("combine", "inv_perm")`` bit of the device's error word
    (``megamoe/ops/errors.py``); both backends follow this rule.
    """
    _check_tensor(expert_out, "expert_out", (torch.bfloat16,), 2)
    _check_tensor(topk_weights, "topk_weights", (torch.float32,), 2)
    _check_tensor(inv_perm, "inv_perm", (torch.int32,), 1)
    num_tokens, top_k = topk_weights.shape
    hidden = expert_out.shape[1]
    if inv_perm.shape[0] != num_tokens * top_k:
        raise ValueError(f"inv_perm: expected ({num_tokens * top_k},), got {tuple(inv_perm.shape)}")
    if expert_out.shape[0] < num_tokens * top_k:
        raise ValueError(f"expert_out: expected at least {num_tokens * top_k} rows, got {expert_out.shape[0]}")
    if shared is not None:
        _check_tensor(shared, "shared", (torch.bfloat16,), 2)
        if tuple(shared.shape) != (num_tokens, hidden):
            raise ValueError(f"shared: expected shape {(num_tokens, hidden)}, got {tuple(shared.shape)}")
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=expert_out.device)
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, hidden):
        raise ValueError(f"out: expected a ({num_tokens}, {hidden}) bf16 tensor, got {tuple(out.shape)} {out.dtype}")
    elif hidden > 1 and out.stride(1) != 1:  # written in place: a copy would not reach the caller
        raise ValueError(f"out: expected unit column stride (rows may be padded), got strides {out.stride()}")
    for name, t in (("inv_perm", inv_perm), ("topk_weights", topk_weights), ("shared", shared), ("out", out)):
        if t is not None and t.device != expert_out.device:
            raise ValueError(f"{name}: expected device {expert_out.device}, got {t.device}")
    if use_triton(expert_out):
        from ..kernels.moe_combine import launch_moe_combine

        if expert_out.stride(1) != 1:
            expert_out = expert_out.contiguous()
        if shared is not None and shared.stride(1) != 1:  # the kernel reads rows of unit column stride
            shared = shared.contiguous()
        return launch_moe_combine(
            expert_out, inv_perm.contiguous(), topk_weights.contiguous(), shared, out,
            interpreter=interpreter_enabled() and not expert_out.is_cuda,
        )
    from . import errors

    idx = inv_perm.long()
    ok = (idx >= 0) & (idx < expert_out.shape[0])
    errors.record(errors.error_word(expert_out.device), errors.flag("combine", "inv_perm"), ~ok)
    acc = shared.float() if shared is not None else torch.zeros((num_tokens, hidden), device=expert_out.device)
    if expert_out.shape[0]:
        gathered = expert_out.index_select(0, torch.where(ok, idx, 0)).float()
    else:
        gathered = torch.zeros((idx.shape[0], hidden), device=expert_out.device)
    gathered = torch.where(ok[:, None], gathered, 0.0).view(num_tokens, top_k, hidden)
    weights = torch.where(ok.view(num_tokens, top_k), topk_weights, 0.0)  # a dropped pair adds 0 * 0
    for j in range(top_k):
        acc = acc + weights[:, j : j + 1] * gathered[:, j]
    out.copy_(acc)
    return out
