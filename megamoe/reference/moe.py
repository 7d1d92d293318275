"""Pure-PyTorch references for the DeepSeek-style NVFP4 MoE block.

Routing (:func:`route`) is the single definition used by the reference *and* the
fast path (``megamoe.ops.moe.route`` validates and calls it), so routing
decisions are identical by construction on the same device and inputs. It is
made of torch ops only, never reads device values on the host, and is
CUDA-graph capturable.

Routing semantics (DeepSeek-V3/V4, "noaux_tc"):

1. ``logits = x.float() @ gate_weight.float().T`` (T, E) in float32.
2. ``scores = score_fn(logits)``: sigmoid, softmax over E, or sqrtsoftplus
   ``sqrt(softplus(logits))`` (DeepSeek-V4); on CPU evaluated in float64 and
   rounded to float32 (:func:`score_function`: the same bits in any batch).
3. Selection key ``= scores + e_score_correction_bias`` (bias optional; used for
   selection only). NaN keys (a token with NaN hidden state) become -inf.
4. Group-limited routing when ``n_group > 1``: group score = sum of the two
   largest keys in the group; the ``topk_group`` best groups are kept, the keys
   of other groups become -inf.
5. The ``top_k`` experts with the largest keys are selected. **Tie-break:** a
   stable descending sort, so among equal keys the lower expert index wins
   (the same rule picks groups in step 4).
6. Weights = the unbiased ``scores`` of the selected experts; with
   ``norm_topk_prob`` divided by their sum (+1e-20); times
   ``routed_scaling_factor``.

NaN policy: a token whose hidden state contains NaN gets NaN scores; it is
routed to experts 0..k-1 (its keys are all -inf after step 3; lowest indices
win) with NaN weights, so its output row is NaN. Other tokens are unaffected
(every stage is row-independent; the scores are the same bits in any batch, see
:func:`score_function`).

Hash routing (:func:`hash_route`; DeepSeek-V4's first ``num_hash_layers``
layers): the ids come from a token-id -> expert-id table, ``ids[t] =
tid2eid[token_ids[t]]`` (``tid2eid`` (vocab, k) int32); no correction bias, no
data-dependent selection. Weights = step 2's unbiased scores gathered at those
ids, then step 6 (renormalised with ``norm_topk_prob``, times
``routed_scaling_factor``). Invalid-input policy (nothing is read out of
bounds): a token id outside ``[0, vocab)``, or a table row with an entry
outside ``[0, E)``, routes that token to experts 0..k-1 with NaN weights (its
output row is NaN, as for a NaN hidden state); a NaN hidden state keeps the
table's ids and gets NaN weights. Other tokens are unaffected.

The layer reference (:func:`moe_forward`) evaluates the whole block in float32
on exactly decoded weights: ``out[t] = shared(x[t]) + sum_j w[t, j] *
expert_{id[t, j]}(x[t])`` with ``expert(x) = W2 @ swiglu(W13 @ x)`` and
``swiglu = silu(min(gate, limit)) * clamp(up, -limit, limit)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..format.tensor import NVFP4Tensor
from .quantize import compute_global_scale, dequantize, quantize

ROUTING_EPS = 1e-20


def score_function(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """(T, E) float32 logits -> (T, E) float32 scores (float64 logits -> float64 scores).

    On CPU, float32 logits are scored in float64 and rounded once to float32, so that a token's scores do not
    depend on the batch that holds it: ATen's CPU float32 sigmoid / softplus give a tensor's vectorised body and
    its scalar tail other last bits, so a token's float32 scores changed with its position (expert parallelism
    splits a batch over ranks and must route as the single-process layer does). The float64 evaluations differ at
    most in their last bits, which the rounding to float32 removes unless a value lies within a float64 ulp of a
    float32 rounding boundary. CUDA evaluates every element with the same function: float32 there."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        return _score(logits.double(), scoring_func).float()
    return _score(logits, scoring_func)


def _score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    raise ValueError(f"scoring_func: expected 'sigmoid', 'softmax' or 'sqrtsoftplus', got {scoring_func!r}")


def router_scores(hidden_states: torch.Tensor, gate_weight: torch.Tensor, scoring_func: str,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Steps 1-2 of the router: (T, H) x (E, H) -> (T, E) scores in ``compute_dtype`` (float32: the routing
    definition shared by every router backend; float64: the high-precision reference of the fused decode op's
    routing guarantee, see :func:`routing_key_bounds`)."""
    x, w = hidden_states.to(compute_dtype), gate_weight.to(compute_dtype)
    return score_function(x @ w.t(), scoring_func)


#: Unit roundoff of float32 (round to nearest).
FP32_UNIT_ROUNDOFF = 2.0 ** -24
#: Relative error allowed for the scoring function and the bias add evaluated in float32 (a few ulps each).
SCORE_REL_ERROR = 64 * FP32_UNIT_ROUNDOFF


def routing_key_bounds(hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                       correction_bias: torch.Tensor | None, scoring_func: str):
    """Float64 selection keys and the interval any float32 evaluation of them may land in (the routing guarantee).

    A float32 logit summed in *any* order over the H products differs from the exact one by at most
    ``gamma_H * sum_h |x_h| |w_eh|`` with ``gamma_H = H u / (1 - H u)``, u = 2**-24 (the classical bound of a
    recursive / blocked / pairwise sum; it covers product rounding too). That logit interval is mapped through
    the (monotone) score function -- for softmax a shift of every logit by at most b_t changes each score by a
    factor in ``[exp(-2 b_t), exp(2 b_t)]`` -- then widened by :data:`SCORE_REL_ERROR` (scoring and bias add
    in float32). Returns float64 ``(key, lo, hi)`` (T, E): the exact keys (score + bias) and their bounds.
    """
    x = hidden_states.double()
    w = gate_weight.double()
    hidden = x.shape[1]
    gamma = hidden * FP32_UNIT_ROUNDOFF / (1 - hidden * FP32_UNIT_ROUNDOFF)
    logits = x @ w.t()
    b = gamma * (x.abs() @ w.abs().t())
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
        spread = torch.exp(2 * b.amax(dim=-1, keepdim=True))
        lo, hi = scores / spread, scores * spread
    else:
        scores = score_function(logits, scoring_func)
        lo, hi = score_function(logits - b, scoring_func), score_function(logits + b, scoring_func)
    bias = 0.0 if correction_bias is None else correction_bias.double()
    key, lo, hi = scores + bias, lo + bias, hi + bias
    slack = SCORE_REL_ERROR * (lo.abs().maximum(hi.abs())) + 1e-38
    return key, lo - slack, hi + slack


def _stable_topk_indices(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties -> lower index first."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style router (see the module docstring for the exact rules).

    hidden_states: (T, H) bf16/fp32. gate_weight: (E, H) bf16/fp32.
    correction_bias: None or (E,) float32 (``e_score_correction_bias``).
    Returns ``(topk_weights (T, k) float32, topk_ids (T, k) int32)``; the k ids
    of a token are in selection order (descending key).
    """
    scores = router_scores(hidden_states, gate_weight, scoring_func)
    key = scores if correction_bias is None else scores + correction_bias.float()
    key = torch.nan_to_num(key, nan=float("-inf"))
    num_tokens, num_experts = key.shape
    if n_group > 1:
        grouped = key.view(num_tokens, n_group, num_experts // n_group)
        group_key = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        group_key = torch.nan_to_num(group_key, nan=float("-inf"))
        keep = _stable_topk_indices(group_key, topk_group)
        group_mask = torch.zeros_like(group_key, dtype=torch.bool).scatter_(1, keep, True)
        key = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    topk_ids = _stable_topk_indices(key, top_k)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + ROUTING_EPS)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def hash_route(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    tid2eid: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    scoring_func: str = "sqrtsoftplus",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash router (see the module docstring): ids from the table, weights from the scores.

    hidden_states: (T, H) bf16/fp32. gate_weight: (E, H). tid2eid: (V, k)
    int32/int64. token_ids: (T,) int32/int64. Returns ``(topk_weights (T, k)
    float32, topk_ids (T, k) int32)``, the ids in table-column order.
    Sync-free torch ops (graph capturable).
    """
    scores = router_scores(hidden_states, gate_weight, scoring_func)
    vocab, top_k = tid2eid.shape
    num_experts = scores.shape[1]
    tok = token_ids.long()
    tok_ok = (tok >= 0) & (tok < vocab)
    rows = tid2eid.index_select(0, tok.clamp(0, vocab - 1)).long()
    ok = tok_ok & ((rows >= 0) & (rows < num_experts)).all(dim=1)
    fallback = torch.arange(top_k, device=rows.device).expand_as(rows)
    ids = torch.where(ok.unsqueeze(1), rows, fallback)
    topk_weights = scores.gather(1, ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + ROUTING_EPS)
    topk_weights = topk_weights * routed_scaling_factor
    topk_weights = torch.where(ok.unsqueeze(1), topk_weights, torch.full_like(topk_weights, float("nan")))
    return topk_weights, ids.to(torch.int32)


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in the input dtype (no clamp for None)."""
    if swiglu_limit is not None:
        gate = torch.clamp(gate, max=swiglu_limit)
        up = torch.clamp(up, min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def _expert_slice(weight: NVFP4Tensor, e: int) -> NVFP4Tensor:
    gs = weight.global_scale
    if gs.dim() != 0:
        gs = gs[e] if gs.shape[0] != 1 else gs[0]
    return NVFP4Tensor(weight.data[e], weight.block_scale[e], gs, weight.shape[1:], weight.row_interleave)


def _fake_quant(x: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """w4a4 activations: NVFP4 round trip (per-row dynamic scale when global_scale is None) -> float32.

    The activations are bf16 on the fast path, so x is rounded to bf16 first and
    the dynamic scale is taken from those bf16 values (as the kernels do).
    """
    if x.numel() == 0:
        return x.float()
    x_bf16 = x.to(torch.bfloat16)
    if global_scale is None:
        global_scale = compute_global_scale(x_bf16, per_row=True)
    return dequantize(quantize(x_bf16, global_scale), torch.bfloat16).float()


def expert_ffn(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    swiglu_limit: float | None,
    *,
    mode: str = "w4a16",
    input_scale: torch.Tensor | None = None,
    inter_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert in float32: ``W2 @ swiglu(W13 @ x)``.

    x: (M, H). w13: NVFP4Tensor (2*I, H), rows ``[gate(I); up(I)]`` (not
    interleaved). w2: NVFP4Tensor (H, I). mode "w4a4" fake-quantizes the
    inputs of both GEMMs (static scales when given, else per-row dynamic); mode "w4a8" quantizes them to
    FP8 (per-row scale) and uses the W4A8 effective weights (``megamoe/reference/w4a8.py``).
    Returns (M, H) float32.
    """
    if mode == "w4a8":
        from .w4a8 import effective_weight, fake_quant_activations

        h = fake_quant_activations(x) @ effective_weight(w13).t()
        inter = h.shape[1] // 2
        act = swiglu(h[:, :inter], h[:, inter:], swiglu_limit)
        return fake_quant_activations(act) @ effective_weight(w2).t()
    xf = _fake_quant(x, input_scale) if mode == "w4a4" else x.float()
    h = xf @ dequantize(w13, torch.float32).t()
    inter = h.shape[1] // 2
    act = swiglu(h[:, :inter], h[:, inter:], swiglu_limit)
    if mode == "w4a4":
        act = _fake_quant(act, inter_scale)
    return act @ dequantize(w2, torch.float32).t()


def moe_forward(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    *,
    swiglu_limit: float | None,
    shared_w13: NVFP4Tensor | None = None,
    shared_w2: NVFP4Tensor | None = None,
    mode: str = "w4a16",
    input_scales: dict | None = None,
    shared_mode: str | None = None,
) -> torch.Tensor:
    """Float32 reference of the whole MoE block (routed experts + shared expert).

    hidden_states: (T, H) bf16. topk_weights: (T, k) fp32; topk_ids: (T, k) int.
    w13: NVFP4Tensor (E, 2*I, H) with rows ``[gate(I); up(I)]`` per expert (the
    checkpoint order, not the kernel's interleaved layout). w2: NVFP4Tensor
    (E, H, I). shared_w13 / shared_w2: (2*Is, H) / (H, Is) NVFP4Tensor or None.
    mode: "w4a16", "w4a4" or "w4a8"; input_scales (w4a4 static scales, else dynamic
    per-row): ``{"l1": 0-d, "l2": (E,), "shared_l1": 0-d, "shared_l2": 0-d}``. shared_mode: the shared
    expert's mode when it differs (w4a8 layers whose routed GEMMs run w4a16 at decode sizes).
    Returns (T, H) float32. Reads device values on the host (a reference).
    """
    scales = input_scales or {}
    num_tokens = hidden_states.shape[0]
    out = torch.zeros((num_tokens, w2.shape[1]), dtype=torch.float32, device=hidden_states.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue  # an out-of-range id drops its pair (as the layer's dispatch does)
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        l2 = scales.get("l2")
        y = expert_ffn(
            hidden_states[token_idx], _expert_slice(w13, e), _expert_slice(w2, e), swiglu_limit,
            mode=mode, input_scale=scales.get("l1"), inter_scale=None if l2 is None else l2[e],
        )
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot].float().unsqueeze(-1))
    if shared_w13 is not None:
        out += expert_ffn(
            hidden_states, shared_w13, shared_w2, swiglu_limit, mode=shared_mode or mode,
            input_scale=scales.get("shared_l1"), inter_scale=scales.get("shared_l2"),
        )
    return out


def dispatch(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference dispatch: sort the T*k (token, slot) pairs by expert, stably.

    topk_ids: (T, k) int. Returns ``(expert_offsets (E,) int32 cumulative row
    ends, perm (T*k,) int64 pair index of each sorted row, row_index (T*k,)
    int32 token of each sorted row)``. Pairs of one expert keep token order.
    An id outside ``[0, E)`` drops its pair: it sorts after every real expert
    (as pseudo-expert E) and counts for no expert.
    """
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat < 0) | (flat >= num_experts), num_experts, flat)
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]
    perm = torch.argsort(flat, stable=True)
    return torch.cumsum(counts, 0).to(torch.int32), perm, (perm // k).to(torch.int32)
