"""Stateless float reference of the whole DeepSeek-V4 model over one sequence (official ``Transformer.forward``).

``embed -> hc_mult copies -> per layer [hc_pre -> attn_norm -> attention -> hc_post; hc_pre -> ffn_norm -> MoE ->
hc_post] -> hc_head -> norm -> head``, bf16 activations rounded where the official bf16 model rounds them
(:mod:`.v4_attention` states the attention's numerics), float32 logits for every position (the official head
returns the last position's only).

MoE (official ``Gate`` / ``Expert`` / ``MoE``), and how it differs from :mod:`megamoe.reference.moe`:

* router logits ``x.float() @ gate.weight.float().T``, scores ``sqrt(softplus(logits))`` (``scoring_func``); the
  bias only shifts the selection key; hash layers (``layer < num_hash_layers``) take the ids from
  ``tid2eid[token]`` and have no bias; weights = unbiased scores at the ids, divided by their sum whenever the
  scoring function is not softmax (the official rule: there is no ``norm_topk_prob`` flag and no epsilon; this
  reference follows it, ``route`` uses ``norm_topk_prob`` and adds 1e-20), times ``routed_scaling_factor``.
  Group-limited routing does not exist in V4 (``n_group`` is ignored). Score-routed layers reuse
  :func:`megamoe.reference.moe.route` (stable top-k; float32 ties are measure-zero);
* expert ``e``: ``gate = bf16(x @ w1.T)``, ``up = bf16(x @ w3.T)`` (bf16 linear outputs, then float32),
  ``act = swiglu(gate, up)`` with the clamps ``gate <= limit``, ``|up| <= limit``
  (:func:`megamoe.reference.moe.swiglu`),
  then **the routing weight multiplies the activation before w2**: ``bf16(w2 @ bf16(weight * act))``;
  :func:`megamoe.reference.moe.moe_forward` keeps gate/up and the activation in float32 and applies the weight to
  the float32 w2 output instead;
* the per-expert bf16 outputs are summed in float32 in expert order, the shared expert's bf16 output added last,
  the sum cast to bf16.

``numerics="blocks"`` composes instead the block references the fast path's ops are tested against
(:func:`blocks_moe_forward`; attention: :mod:`.v4_attention`) at the fast path's rounding points: on the CPU, under
:class:`exact_cpu_products`, ``megamoe.models.model.V4Model`` (prefill + batched decode) reproduces its logits bit
for bit (tests/models/test_v4_model.py). It stays an independent implementation: float ops on the decoded weights,
no layer or model class.

``attention_p_rounding="kernel"`` ("blocks" only) replaces the attention's float32 P with the attention kernel's
blockwise bf16-P evaluation (:func:`kernel_p_rounding`): the reference for the fast model on the GPU / under the
Triton interpreter, whose attention kernel rounds P to bf16 per row block (as the official ``sparse_attn`` does),
issue 9. The CPU fast path runs the float32-P op reference, so it is compared with the default.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from ..layers.moe import FUSE_SHARED_MAX_TOKENS
from ..models.config import CSA_RATIO, V4Config
from ..models.v4_weights import DecodedView
from .forced import ForcedDecisionError, follow, router_key_bounds
from .gemm import swiglu_reference
from .moe import ROUTING_EPS, hash_route, route, router_scores, swiglu
from .v4_attention import attention_forward, linear_bf16
from .v4_numerics import hc_head, hc_post, hc_pre, rms_norm

_BF16 = torch.bfloat16


class exact_cpu_products(TorchFunctionMode):
    """Context manager: every matrix product of CPU float32 / bf16 tensors (``@``, ``matmul``, ``mm``, ``bmm``,
    ``einsum``, ``linear``, ``addmm``) is computed in float64 and rounded once to the dtype the op returns.

    A float32 BLAS product's bits depend on the kernel the library picks for the shape (on x86 MKL a 1-3 row
    product sums in another order than a 4+ row one), so a decode step (1 row per request) and a stateless
    recomputation of the whole sequence differ by an ulp now and then, which a bf16 rounding can turn into a
    4e-3 step (and the bf16 per-head q norm into a whole head's scale). In float64 the sum of these products is
    exact to far below a float32 ulp, so the rounded result no longer depends on the row count or summation
    order. Used by the CPU tests to compare the fast model with the reference model bit for bit: with it the only
    difference left between the two would be a rounding point, not BLAS blocking (the kernels' own tests cover
    accumulation order).
    """

    _OPS = frozenset({torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.mm, torch.Tensor.mm,
                      torch.bmm, torch.Tensor.bmm, torch.einsum, torch.addmm, torch.nn.functional.linear})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._OPS:
            return func(*args, **kwargs)
        operands = args[1:] if func is torch.einsum else args
        if func is torch.einsum and len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        tensors = [a for a in operands if isinstance(a, torch.Tensor)]
        if not tensors or any(t.device.type != "cpu" or t.dtype not in (torch.float32, _BF16) for t in tensors):
            return func(*args, **kwargs)
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)

        def up(a):
            return a.double() if isinstance(a, torch.Tensor) else a

        if func is torch.einsum:
            out = func(args[0], *[up(a) for a in operands])
        else:
            out = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return out.to(dtype)


def as_decoded(w: Mapping) -> Mapping:
    """Checkpoint-format tensors (NVFP4 triples) -> a :class:`~megamoe.models.v4_weights.DecodedView` (decodes each
    weight when it is read); already decoded weights as they are."""
    if isinstance(w, DecodedView) or not any(name.endswith(".weight_scale") for name in w):
        return w
    return DecodedView(w)


def gate_forward(cfg: V4Config, layer: int, w: Mapping, x: torch.Tensor, tokens: torch.Tensor):
    """Official ``Gate``: x (T, hidden) bf16, tokens (T,) -> (weights (T, k) float32, ids (T, k) int32)."""
    m = cfg.moe
    p = f"layers.{layer}.ffn.gate."
    normalize = m.scoring_func != "softmax"
    if layer < cfg.num_hash_layers:
        scores = router_scores(x, w[p + "weight"], m.scoring_func)
        ids = w[p + "tid2eid"][tokens.long()].long()
        weights = scores.gather(1, ids)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * m.routed_scaling_factor, ids.to(torch.int32)
    return route(x, w[p + "weight"], w[p + "bias"], top_k=m.top_k, scoring_func=m.scoring_func,
                 norm_topk_prob=normalize, routed_scaling_factor=m.routed_scaling_factor)


def expert_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   weight: torch.Tensor | None, swiglu_limit: float | None) -> torch.Tensor:
    """Official ``Expert.forward``: x (M, hidden) bf16, weight (M, 1) float32 or None -> (M, hidden) bf16."""
    gate = linear_bf16(x, w1).float()
    up = linear_bf16(x, w3).float()
    act = swiglu(gate, up, swiglu_limit)
    if weight is not None:
        act = weight.float() * act
    return linear_bf16(act.to(_BF16), w2)


def moe_block_forward(cfg: V4Config, layer: int, w: Mapping, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Official ``MoE.forward``: x (T, hidden) bf16 (after ffn_norm), tokens (T,) -> (T, hidden) bf16."""
    m = cfg.moe
    p = f"layers.{layer}.ffn."
    weights, ids = gate_forward(cfg, layer, w, x, tokens)
    ids = ids.long()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        q = f"{p}experts.{e}."
        out = expert_forward(x[rows], w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"],
                             weights[rows, slot, None], m.swiglu_limit)
        y.index_add_(0, rows, out.float())
    if m.shared_intermediate_size:
        q = p + "shared_experts."
        y += expert_forward(x, w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"], None,
                            m.swiglu_limit).float()
    return y.to(_BF16)


def blocks_expert_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                          swiglu_limit: float | None) -> torch.Tensor:
    """One expert as the grouped NVFP4 GEMMs compute it (:func:`megamoe.reference.gemm.nvfp4_grouped_mm`):
    x (M, hidden) bf16 -> float32 ``x @ W13.T`` over the interleaved gate/up rows, the fused SwiGLU epilogue in
    float32 (:func:`~megamoe.reference.gemm.swiglu_reference`), one bf16 rounding; ``bf16(act @ w2.T)``.
    Returns (M, hidden) bf16 (the routing weight is applied later, by the combine)."""
    w13 = torch.stack((w1.float(), w3.float()), dim=1).reshape(-1, w1.shape[1])  # row 2j gate j, 2j+1 up j
    act = swiglu_reference(x.float() @ w13.t(), swiglu_limit).to(_BF16)
    return linear_bf16(act, w2)


def blocks_moe_forward(cfg: V4Config, layer: int, w: Mapping, x: torch.Tensor, tokens: torch.Tensor,
                       shared_first: torch.Tensor | None = None, *, forced_ids: torch.Tensor | None = None,
                       decisions_mode: str = "force", decision_report: list | None = None) -> torch.Tensor:
    """``numerics="blocks"`` MoE: the references the fast MoE layer's ops are tested against, composed with its
    rounding points. x (T, hidden) bf16 (after ffn_norm), tokens (T,) -> (T, hidden) bf16.

    * routing: :func:`megamoe.reference.moe.route` / :func:`~megamoe.reference.moe.hash_route` (``norm_topk_prob``
      with the 1e-20 epsilon; the official renormalisation has none);
    * each expert: :func:`blocks_expert_forward` (bf16 SwiGLU output, bf16 expert output, unweighted);
    * combine (``megamoe.ops.moe.combine``): float32 ``sum_j w_j * y_j`` in slot order and the shared expert's
      bf16 output, rounded once. The shared expert is added first where the fast layer runs it apart
      (``shared_first[t]``: tokens of a call with more than ``FUSE_SHARED_MAX_TOKENS`` rows) and last, as slot k
      with weight 1.0, where it runs fused into the grouped GEMMs (decode batches, short prompts).

    forced_ids: (T' >= T, k) int, another implementation's expert ids per token (slot order), followed where the
    reference's own keys leave them tied (:func:`megamoe.reference.forced.follow` with
    :func:`~megamoe.reference.forced.router_key_bounds`; ``decisions_mode`` / ``decision_report`` as there); the
    weights are then the reference's own scores at the forced ids. Hash-routed layers: must equal the table's ids.
    """
    m = cfg.moe
    p = f"layers.{layer}.ffn."
    if layer < cfg.num_hash_layers:
        weights, ids = hash_route(x, w[p + "gate.weight"], w[p + "gate.tid2eid"], tokens,
                                  scoring_func=m.scoring_func, norm_topk_prob=m.norm_topk_prob,
                                  routed_scaling_factor=m.routed_scaling_factor)
        if forced_ids is not None:
            f = forced_ids[: ids.shape[0]].to(ids.device, torch.int64)
            bad = (f != ids.long()).any(dim=1).nonzero().reshape(-1).tolist()
            if bad:
                t = bad[0]
                msg = (f"moe decision, layer {layer} (hash-routed), position {t}: forced {f[t].tolist()}, the table's "
                       f"{ids[t].tolist()} (no tie possible)")
                if decision_report is not None:
                    decision_report.append(dict(kind="moe", layer=layer, position=t, own=ids[t].tolist(),
                                                forced=f[t].tolist(), set_differs=True, ok=False,
                                                need=float("inf"), gap=float("inf")))
                if decisions_mode == "force":
                    raise ForcedDecisionError(msg)
    else:
        weights, ids = route(x, w[p + "gate.weight"], w[p + "gate.bias"], top_k=m.top_k, scoring_func=m.scoring_func,
                             norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor)
        if forced_ids is not None:
            key, lo, hi = router_key_bounds(x, w[p + "gate.weight"], w[p + "gate.bias"], m.scoring_func)
            use = follow("moe", layer, key, lo, hi, ids, forced_ids, None, mode=decisions_mode,
                         report=decision_report)
            changed = (use != ids).any(dim=1, keepdim=True)
            if bool(changed.any()):  # the reference's own weights at the forced ids (route's formula)
                fw = router_scores(x, w[p + "gate.weight"], m.scoring_func).gather(1, use.long())
                if m.norm_topk_prob:
                    fw = fw / (fw.sum(dim=-1, keepdim=True) + ROUTING_EPS)
                weights = torch.where(changed, fw * m.routed_scaling_factor, weights)
                ids = use
    ids = ids.long()
    T, k = ids.shape
    y = torch.zeros((T, k, x.shape[1]), dtype=_BF16, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        q = f"{p}experts.{e}."
        y[rows, slot] = blocks_expert_forward(x[rows], w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"],
                                              m.swiglu_limit)
    shared = None
    if m.shared_intermediate_size:
        q = p + "shared_experts."
        shared = blocks_expert_forward(x, w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"],
                                       m.swiglu_limit).float()
    first = torch.zeros(T, dtype=torch.bool, device=x.device) if shared_first is None else shared_first
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if shared is not None:
        acc = torch.where(first[:, None], shared, acc)
    for j in range(k):
        acc = acc + weights[:, j: j + 1] * y[:, j].float()
    if shared is not None:
        acc = torch.where(first[:, None], acc, acc + 1.0 * shared)
    return acc.to(_BF16)


def _hc_pre(cfg: V4Config, w: Mapping, prefix: str, h: torch.Tensor):
    return hc_pre(h, w[prefix + "_fn"], w[prefix + "_scale"], w[prefix + "_base"], hc=cfg.hc_mult,
                  iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)


def block_forward(cfg: V4Config, layer: int, w: Mapping, h: torch.Tensor, tokens: torch.Tensor, *,
                  numerics: str = "official", trace: dict | None = None,
                  shared_first: torch.Tensor | None = None, p_rounding: tuple | None = None,
                  forced: Mapping | None = None, decisions_mode: str = "force",
                  decision_report: list | None = None) -> torch.Tensor:
    """Official ``Block.forward``: h (T, hc_mult, hidden) bf16 -> same. ``trace`` (a dict) receives the
    attention result dict under ``"attn"`` and the MoE input / output under ``"ffn_in"`` / ``"ffn_out"``.
    ``numerics="blocks"``: the MoE is :func:`blocks_moe_forward` (``shared_first`` (T,) bool, see there) and
    ``p_rounding`` the attention's (:func:`megamoe.reference.v4_attention.attention_forward`). ``forced``
    ("blocks" only): this layer's forced decisions, a dict ``moe_ids`` / ``index_topk`` (:func:`model_forward`)."""
    p = f"layers.{layer}."
    x, post, comb = _hc_pre(cfg, w, p + "hc_attn", h)
    forced = forced or {}
    a = attention_forward(cfg, layer, w, rms_norm(x, w[p + "attn_norm.weight"], cfg.norm_eps), numerics=numerics,
                          p_rounding=p_rounding, forced_topk=forced.get("index_topk"),
                          decisions_mode=decisions_mode, decision_report=decision_report)
    h = hc_post(a["out"].to(_BF16), h, post, comb)
    x, post, comb = _hc_pre(cfg, w, p + "hc_ffn", h)
    x = rms_norm(x, w[p + "ffn_norm.weight"], cfg.norm_eps)
    if numerics == "blocks":
        y = blocks_moe_forward(cfg, layer, w, x, tokens, shared_first, forced_ids=forced.get("moe_ids"),
                               decisions_mode=decisions_mode, decision_report=decision_report)
    else:
        y = moe_block_forward(cfg, layer, w, x, tokens)
    if trace is not None:
        trace.update(attn=a, ffn_in=x, ffn_out=y)
    return hc_post(y, h, post, comb)


def kernel_p_rounding(cfg: V4Config, layer: int, seq_len: int, prefill_tokens: int, *, device,
                      max_context: int | None = None, decode_batch: int = 1) -> tuple:
    """The attention kernel's calls for one layer of a fast ``megamoe.models.model.V4Model`` run, as the
    ``p_rounding`` of :func:`megamoe.reference.v4_attention.attention_forward`: ``(block_n, num_splits (seq_len,)
    list, entry_columns)``.

    The first ``prefill_tokens`` positions were one prefill call (``prefill_tokens`` query rows), the rest decode
    steps of ``decode_batch`` requests each. ``block_n`` and the split counts are the kernel's on ``device``
    (CUDA: ``main_block_n`` of the default main kernel; otherwise the interpreter's ``INTERPRETER_CONFIG``), the
    split counts from ``choose_num_splits`` of each call's shape: window list ``window_size`` wide, entry list (the
    cache's) CSA ``min(index_topk, max(max_entries, 1))``, HCA ``max(max_entries, 1)``, window-only layers 0, with
    ``max_entries = max_context // ratio`` (``max_context``: the fast model's, default ``cfg.max_seq_len`` as
    there).
    """
    from ..kernels import sparse_attention as kernel  # the kernel's tile config and split rule

    interpreter = torch.device(device).type != "cuda"
    # the default main kernel's (MEGAMOE_ATTN_IMPL) for this model's rows, FP8 scale blocks of the official 64
    block_n = kernel.main_block_n(interpreter=interpreter, head_dim=cfg.head_dim, rope_dim=cfg.rope_dim)
    ratio = cfg.compress_ratios[layer]
    max_entries = max((max_context or cfg.max_seq_len) // ratio, 1) if ratio else 0
    entry_columns = min(cfg.index_topk, max_entries) if ratio == CSA_RATIO else max_entries

    def splits(rows: int) -> int:
        return kernel.choose_num_splits(rows, cfg.num_heads, cfg.window_size, entry_columns,
                                        interpreter=interpreter, block_n=block_n)[0]

    decode = seq_len - prefill_tokens
    num_splits = [splits(prefill_tokens)] * prefill_tokens + ([splits(decode_batch)] * decode if decode > 0 else [])
    return block_n, num_splits, entry_columns


def model_forward(cfg: V4Config, w: Mapping, tokens: torch.Tensor, *, numerics: str = "official",
                  layers: Sequence[int] | None = None, prefill_tokens: int | None = None,
                  attention_p_rounding: str | None = None, max_context: int | None = None,
                  decode_batch: int = 1, forced_decisions: Sequence[Mapping] | None = None,
                  decisions_mode: str = "force", decision_report: list | None = None) -> torch.Tensor:
    """Logits (T, vocab) float32 of one sequence ``tokens`` (T,) int.

    w: decoded weights by official name (:func:`megamoe.models.v4_weights.decoded_state_dict`) or the checkpoint
    tensors themselves (decoded as they are read, every call). layers: run only these layers, in order (default:
    all; a debugging aid). numerics: "official" (the official bf16 model), "per_entry" / "official_fp32_index"
    (attention variants, :mod:`.v4_attention`), or "blocks": the fast path's block references and rounding points
    (attention: :mod:`.v4_attention`; MoE: :func:`blocks_moe_forward`). prefill_tokens ("blocks" only): the
    first ``prefill_tokens`` tokens were one prefill call of the fast model, the rest decode steps (default: all
    of them one call); it decides where the combine adds the shared expert.
    attention_p_rounding ("blocks" only): None (the attention's float32 P) or "kernel": the attention kernel's
    blockwise bf16 P with the tile size and split counts of the kernel on ``tokens.device`` for a fast model of
    ``max_context`` tokens (default ``cfg.max_seq_len``) that prefilled ``prefill_tokens`` and then decoded in
    batches of ``decode_batch`` requests (:func:`kernel_p_rounding`).
    forced_decisions ("blocks" only): another implementation's discrete decisions for this sequence, one dict per
    layer (indexed by layer number) with ``moe_ids`` (T' >= T, top_k) int (expert ids per position, slot order) and
    ``index_topk`` (T', n) int (CSA: selected entries per query, best first, -1 = none; else None), as
    ``megamoe.models.model.V4Model.recorded_decisions`` returns them. ``decisions_mode="force"``: each decision
    that differs from the reference's own is checked to be a near-tie within the tolerances stated in
    :mod:`megamoe.reference.forced` and then used (else :class:`~megamoe.reference.forced.ForcedDecisionError`);
    ``"compare"``: the reference keeps its own decisions and only reports. decision_report (a list): one dict per
    differing decision (kind "moe" / "index", layer, position, own, forced, set_differs, ok, need, gap).
    """
    if forced_decisions is not None and numerics != "blocks":
        raise ValueError(f"forced_decisions: only with numerics='blocks', got numerics={numerics!r}")
    if attention_p_rounding not in (None, "kernel"):
        raise ValueError(f"attention_p_rounding: expected None or 'kernel', got {attention_p_rounding!r}")
    if attention_p_rounding is not None and numerics != "blocks":
        raise ValueError(f"attention_p_rounding: only with numerics='blocks', got numerics={numerics!r}")
    w = as_decoded(w)
    tokens = tokens.reshape(-1)
    h = w["embed.weight"][tokens.long()].to(_BF16)
    h = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    P = tokens.shape[0] if prefill_tokens is None else prefill_tokens
    fused = cfg.moe.shared_intermediate_size == cfg.moe.intermediate_size  # the layer's fused shared expert
    first = P if P > FUSE_SHARED_MAX_TOKENS or not fused else 0
    shared_first = torch.arange(tokens.shape[0], device=tokens.device) < (tokens.shape[0] if not fused else first)
    for layer in (range(cfg.num_layers) if layers is None else layers):
        rounding = None if attention_p_rounding is None else kernel_p_rounding(
            cfg, layer, tokens.shape[0], P, device=tokens.device, max_context=max_context, decode_batch=decode_batch)
        h = block_forward(cfg, layer, w, h, tokens, numerics=numerics, shared_first=shared_first,
                          p_rounding=rounding, forced=None if forced_decisions is None else forced_decisions[layer],
                          decisions_mode=decisions_mode, decision_report=decision_report)
    x = hc_head(h, w["hc_head_fn"], w["hc_head_scale"], w["hc_head_base"], hc_eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
    x = rms_norm(x, w["norm.weight"], cfg.norm_eps)
    return x.float() @ w["head.weight"].float().t()


def greedy_generate(cfg: V4Config, w: Mapping, prompt: Sequence[int], steps: int, *,
                    numerics: str = "official", attention_p_rounding: str | None = None,
                    max_context: int | None = None, decode_batch: int = 1,
                    forced_decisions: Sequence[Mapping] | None = None, decisions_mode: str = "force",
                    decision_report: list | None = None) -> list:
    """``steps`` greedily generated token ids after ``prompt`` (the full sequence is recomputed every step; the
    prompt counts as one prefill call). ``attention_p_rounding``, ``max_context``, ``decode_batch``,
    ``forced_decisions`` (covering at least ``len(prompt) + steps - 1`` positions), ``decisions_mode``: as
    :func:`model_forward`; ``decision_report`` gets the last step's report (every position of the sequence)."""
    w = as_decoded(w)
    if isinstance(w, DecodedView):
        w = dict(w.items())  # decode once for all steps
    device = w["embed.weight"].device
    seq = [int(t) for t in prompt]
    out = []
    for _ in range(steps):
        report = None if decision_report is None else []
        logits = model_forward(cfg, w, torch.tensor(seq, device=device), numerics=numerics,
                               prefill_tokens=len(prompt), attention_p_rounding=attention_p_rounding,
                               max_context=max_context, decode_batch=decode_batch,
                               forced_decisions=forced_decisions, decisions_mode=decisions_mode,
                               decision_report=report)
        nxt = int(logits[-1].argmax())
        seq.append(nxt)
        out.append(nxt)
    if decision_report is not None and steps:
        decision_report.extend(report)
    return out
