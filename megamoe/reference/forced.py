"""Following another implementation's discrete decisions where the reference's own scores leave them tied (issue 9).

The fast model and the reference compute the same continuous quantities to within their summation orders and the
upstream rounding differences (a few 1e-3 relative). The model's discrete decisions -- the MoE router's top-k
experts and the CSA indexer's top-k entries -- turn that into a jump wherever two candidates' scores are closer
than the difference: a different expert or entry, a different output. Such a decision is not a bug, and comparing
outputs across it measures nothing. So the reference can be given the fast model's decisions
(``megamoe.models.model.V4Model.record_decisions``) and take them instead of its own top-k **only after checking**
that each is a top-k of some scores within a stated tolerance of its own exact ones:

* every score ``s_j`` gets an interval ``[lo_j, hi_j]`` (:func:`router_key_bounds`, :func:`index_score_bounds`);
* a forced selection ``F`` (k candidates, in the forced order) is admissible when it is a top-k of some point of
  that box: ``min_{f in F} hi_f >= max_{j not in F} lo_j`` (the set) and, in order,
  ``min_{a < b} hi_{F_a} >= lo_{F_b}`` (the order: the slot order is the combine's / attention's summation order);
* otherwise :class:`ForcedDecisionError` (that would be a real bug: a choice no tolerance explains).

Stated tolerances (module constants):

* router (:data:`ROUTER_INPUT_REL`): the float32 summation bound of
  :func:`megamoe.reference.moe.routing_key_bounds` (``gamma_H sum_h |x_h w_eh|``) plus an input perturbation of
  relative L2 size ``ROUTER_INPUT_REL`` of the MoE input, ``|dx . w_e| <= ROUTER_INPUT_REL |x| |w_e|``
  (Cauchy-Schwarz: any direction of the difference), pushed through the monotone score function. 1e-2: the fast
  and reference MoE inputs differ by the upstream continuous error, which on the H100 gives ~5-8e-3 on the logits
  after all 4 tiny layers (benchmarks/NOTES_model.md, issue 9); a random-direction difference of that size moves a
  logit by ~|dx||w|/sqrt(H), ~10x less than the bound at H = 128, so the bound is not tight, but a wrong expert from
  a real bug is one with a gap of order the logits' spread (~0.09 |x||w| at H = 128), 9x beyond it.
* indexer (:data:`INDEX_SCORE_REL`): ``s_n = sum_h w_h relu(q_h . k_n)``; relu is 1-Lipschitz, so
  ``|ds_n| <= sum_h |w_h| |q_h| |k_n| (rho_w + rho_q + rho_k)`` for relative L2 errors ``rho`` of the head weight, the
  query head and the key. q and the keys are FP4 (e2m1, 32-blocks) simulated: an input error ``rho`` flips the
  codes of elements within ``rho |x_i|`` of a rounding midpoint, each flip a whole step (~1/4 of the element), so
  the quantized vector moves by ``~sqrt(step * rho) ~ 0.5 sqrt(rho)`` relative in L2 -- 1.6e-2 for rho = 1e-3.
  Hence ``tol_n = INDEX_SCORE_REL * sum_h |w_h| |q_h| |k_n|`` with INDEX_SCORE_REL = 3e-2 (~ 0.5 sqrt(1e-3) for q and k
  together, the head weight's bf16 part negligible).

Both are upper bounds for a legitimate near-tie, not measured margins: each forced decision is reported with its
"need" (the fraction of the tolerance it used, in (0, 1]) so a diagnostic shows how close to the bound they are.
"""
from __future__ import annotations

import torch

from .moe import FP32_UNIT_ROUNDOFF, SCORE_REL_ERROR, score_function

#: Relative L2 size of the MoE input difference the router tolerance allows (module docstring).
ROUTER_INPUT_REL = 1e-2
#: Relative size of the indexer score difference, in units of ``sum_h |w_h| |q_h| |k_n|`` (module docstring).
INDEX_SCORE_REL = 3e-2

MODES = ("force", "compare")


class ForcedDecisionError(ValueError):
    """A forced decision is not within the stated tolerance of the reference's own scores (a real difference)."""


def router_key_bounds(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, scoring_func: str,
                      input_rel: float = ROUTER_INPUT_REL):
    """x (T, H), gate_weight (E, H) -> float64 ``(key, lo, hi)`` (T, E): the exact selection keys (score + bias)
    and the interval a float32 evaluation on an input within relative L2 ``input_rel`` of ``x`` may give."""
    xd, wd = x.double(), gate_weight.double()
    H = xd.shape[1]
    gamma = H * FP32_UNIT_ROUNDOFF / (1 - H * FP32_UNIT_ROUNDOFF)
    logits = xd @ wd.t()
    b = gamma * (xd.abs() @ wd.abs().t()) + input_rel * xd.norm(dim=1, keepdim=True) * wd.norm(dim=1)[None, :]
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
        spread = torch.exp(2 * b.amax(dim=-1, keepdim=True))
        lo, hi = scores / spread, scores * spread
    else:
        scores = score_function(logits, scoring_func)
        lo, hi = score_function(logits - b, scoring_func), score_function(logits + b, scoring_func)
    bias = 0.0 if bias is None else bias.double()
    key, lo, hi = scores + bias, lo + bias, hi + bias
    slack = SCORE_REL_ERROR * lo.abs().maximum(hi.abs()) + 1e-38
    return key, lo - slack, hi + slack


def index_score_bounds(scores: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       rel: float = INDEX_SCORE_REL):
    """scores (T, N) (the reference's), q (T, nh, dh), weights (T, nh), keys (N, dh) -> float64 ``(key, lo, hi)``
    with ``tol = rel * sum_h |w_h| |q_h| |k_n|`` plus a float32 ulp of the score."""
    scale = weights.double().abs() * q.double().norm(dim=-1)  # (T, nh)
    tol = rel * scale.sum(dim=1, keepdim=True) * keys.double().norm(dim=-1)[None, :]
    key = scores.double()
    tol = tol + key.abs() * 2.0 ** -23
    return key, key - tol, key + tol


def follow(kind: str, layer: int, key: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, own: torch.Tensor,
           forced: torch.Tensor, valid: torch.Tensor | None, *, mode: str = "force",
           report: list | None = None) -> torch.Tensor:
    """Check a forced selection row by row and return the one to use.

    kind, layer: for messages / the report ("moe" / "index"). key, lo, hi: (T, N) float64 (:func:`router_key_bounds`
    / :func:`index_score_bounds`); own: (T, n) int the reference's selection (best first, -1 = none, at the end);
    forced: (T', n') int (T' >= T rows: positions 0..T-1 are used; -1 = none; the valid entries first);
    valid: (T, N) bool candidates (None: all). Rows whose valid forced entries equal ``own``'s are unchanged.
    mode "force": returns ``own`` with the differing rows replaced by the forced ones (padded / cut to width n)
    after checking each (raises :class:`ForcedDecisionError`); "compare": returns ``own`` and only reports
    (nothing raised). report (a list): one dict per differing row: kind, layer, position, own, forced, set_differs,
    ok, need (largest gap over allowed gap among the violated orderings, <= 1 when admissible), gap (the reference's
    key difference the forced choice overrode).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    T, n = own.shape
    if forced.shape[0] < T:
        raise ValueError(f"forced decisions ({kind}, layer {layer}): {forced.shape[0]} rows recorded, {T} needed")
    forced = forced[:T].to(own.device, torch.int64)
    own64 = own.to(torch.int64)
    width = max(n, forced.shape[1])

    def pad(t):
        return torch.cat([t, t.new_full((T, width - t.shape[1]), -1)], dim=1) if t.shape[1] < width else t

    differs = (pad(forced) != pad(own64)).any(dim=1)
    if not bool(differs.any()):
        return own
    out = own64.clone()
    key, lo, hi = key.cpu(), lo.cpu(), hi.cpu()
    for t in differs.nonzero().reshape(-1).tolist():
        f = forced[t][forced[t] >= 0].cpu()
        o = own64[t][own64[t] >= 0].cpu()
        cand = torch.ones(key.shape[1], dtype=torch.bool) if valid is None else valid[t].cpu().clone()
        where = f"{kind} decision, layer {layer}, position {t}: forced {f.tolist()}, reference's own {o.tolist()}"
        if f.numel() != o.numel() or f.unique().numel() != f.numel() or not bool(cand[f].all()):
            if mode == "force":
                raise ForcedDecisionError(f"{where}: not a selection of {o.numel()} distinct valid candidates")
            if report is not None:
                report.append(dict(kind=kind, layer=layer, position=t, own=o.tolist(), forced=f.tolist(),
                                   set_differs=True, ok=False, need=float("inf"), gap=float("inf")))
            continue
        rest = cand.clone()
        rest[f] = False
        # set: min hi over F >= max lo over the rest; order: min_{a<b} hi[F_a] >= lo[F_b]
        need, gap = 0.0, 0.0
        if bool(rest.any()):
            j = int(torch.where(rest, lo[t], torch.tensor(float("-inf"), dtype=lo.dtype)).argmax())
            i = int(f[hi[t, f].argmin()])
            gap = max(gap, float(key[t, j] - key[t, i]))
            allowed = float((hi[t, i] - key[t, i]) + (key[t, j] - lo[t, j]))
            need = max(need, float(key[t, j] - key[t, i]) / allowed if allowed > 0 else float("inf"))
        for b in range(1, f.numel()):
            a = int(f[:b][hi[t, f[:b]].argmin()])
            c = int(f[b])
            d = float(key[t, c] - key[t, a])
            if d > 0:
                allowed = float((hi[t, a] - key[t, a]) + (key[t, c] - lo[t, c]))
                need = max(need, d / allowed if allowed > 0 else float("inf"))
                gap = max(gap, d)
        set_differs = set(f.tolist()) != set(o.tolist())
        ok = need <= 1.0
        if report is not None:
            report.append(dict(kind=kind, layer=layer, position=t, own=o.tolist(), forced=f.tolist(),
                               set_differs=set_differs, ok=ok, need=need, gap=gap))
        if mode == "force":
            if not ok:
                raise ForcedDecisionError(
                    f"{where}: outside the stated tolerance ({'set' if set_differs else 'order'}: the reference "
                    f"prefers another candidate by {gap:.3e} in its own key, {need:.2f}x the allowed gap; "
                    "megamoe.reference.forced states the bound)")
            row = torch.full((n,), -1, dtype=torch.int64)
            row[: min(n, f.numel())] = f[:n]
            out[t] = row.to(out.device)
    return out.to(own.dtype)
