"""Issue 9 diagnostic: the fast model's discrete decisions against the "blocks" reference's own, per step.

    python benchmarks/diag_v4_decisions.py [dense|sparse] [steps] [plain|peaked]

Free-runs the tiny model (tests/models/test_v4_model.py's prompts, seed 1234, one decode batch) with
``V4Model.record_decisions`` on, then runs the reference (``numerics="blocks"``, attention_p_rounding="kernel" on
CUDA / under TRITON_INTERPRET=1, float32 P on the plain CPU path) twice on the fast tokens:

* unforced (``decisions_mode="compare"``): its own decisions; every one that differs from the fast model's is listed
  with its kind, layer, whether the set or only the order differs, and the fraction of the stated tolerance
  (megamoe.reference.forced) the fast choice needs (``need`` > 1: outside it; unforced, decisions downstream of a
  first difference see other inputs, so only the first per position is meaningful);
* forced (``decisions_mode="force"``): the fast decisions where admissible (raises otherwise).

Per prompt and step: logits relative L2 error without / with forcing, the reference's top-2 margin, token flips,
and the decisions that differ at that step's position. Device: CUDA if present, else CPU (set TRITON_INTERPRET=1
to run the Triton kernels in the interpreter; slow: minutes per prompt).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import test_v4_model as T  # noqa: E402  (prompts, configs, peaked weights)
from megamoe.models.v4_weights import random_state_dict  # noqa: E402
from megamoe.reference import v4_model as ref_model  # noqa: E402
from megamoe.reference.forced import ForcedDecisionError  # noqa: E402


def main():
    selection = sys.argv[1] if len(sys.argv) > 1 else "sparse"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else T.STEPS
    peaked = len(sys.argv) > 3 and sys.argv[3] == "peaked"
    prompts = [int(p) for p in os.environ.get("PROMPTS", "0,1,2,3").split(",")]
    prompts = [T.PROMPTS[i] for i in prompts]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    cfg = T._config(selection)
    sd = random_state_dict(cfg, seed=1234)
    if peaked:
        sd = T.peaked_state_dict(cfg, sd)
    w = {k: v.to(dev) for k, v in T._decoded(cfg, sd).items()}
    sd = {k: v.to(dev) for k, v in sd.items()}
    model = T._new_model(cfg, sd, dev, prompts, steps, head_dtype=torch.float32)
    model.record_decisions()
    tokens, logits = T._free_running(model, prompts, steps)
    kwargs = dict(attention_p_rounding="kernel", max_context=model.max_context, decode_batch=len(prompts)) \
        if kernels else {}
    print(f"# {selection}, {steps} steps, {'peaked' if peaked else 'plain'} weights, device {dev}, "
          f"kernels {'on' if kernels else 'off (op references)'}")
    for r, (prompt, toks) in enumerate(zip(prompts, tokens)):
        dec = model.recorded_decisions(r)
        seq = torch.tensor(prompt + toks[:-1], device=dev)
        P = len(prompt)
        base = dict(numerics="blocks", prefill_tokens=P, forced_decisions=dec, **kwargs)
        own = []
        free = ref_model.model_forward(cfg, w, seq, decisions_mode="compare", decision_report=own, **base)
        forced, err = [], None
        try:
            fref = ref_model.model_forward(cfg, w, seq, decisions_mode="force", decision_report=forced, **base)
        except ForcedDecisionError as e:
            fref, err = None, e
        got = logits[r]
        free = free[P - 1:].float().cpu()

        def rel(ref):
            return (got - ref).norm(dim=1) / ref.norm(dim=1)

        rel_free = rel(free)
        rel_forced = rel(fref[P - 1:].float().cpu()) if fref is not None else None
        top2 = free.topk(2, dim=1).values
        margin = top2[:, 0] - top2[:, 1]
        print(f"\n## prompt {r} (len {P}): unforced median {float(rel_free.median()):.3e} max "
              f"{float(rel_free.max()):.3e}; forced "
              + (f"median {float(rel_forced.median()):.3e} max {float(rel_forced.max()):.3e}" if fref is not None
                 else f"FAILED: {err}"))
        print(f"   differing decisions: unforced {len(own)} ({sum(d['set_differs'] for d in own)} set), forced "
              f"{len(forced)} ({sum(d['set_differs'] for d in forced)} set); max tolerance used (forced) "
              f"{max([d['need'] for d in forced], default=0.0):.3f}")
        by_pos = {}
        for d in own:
            by_pos.setdefault(d["position"], []).append(("own", d))
        for d in forced:
            by_pos.setdefault(d["position"], []).append(("forced", d))
        print("   step | rel unforced | rel forced | ref top-2 margin | token flip (unforced) | decisions at the "
              "step's position (run, kind, layer, set/order, tolerance used)")
        ref_tok = free.argmax(dim=1).tolist()
        for i in range(steps):
            pos = P - 1 + i
            ds = by_pos.get(pos, [])
            flip = ref_tok[i] != toks[i]
            show = ds or flip or float(rel_free[i]) > 2e-2
            if not show:
                continue
            desc = ", ".join(f"{run}:{d['kind']}/L{d['layer']}/{'set' if d['set_differs'] else 'order'}/"
                             f"{d['need']:.2f}" for run, d in ds)
            print(f"   {i:4d} | {float(rel_free[i]):.3e} | "
                  f"{float(rel_forced[i]) if rel_forced is not None else float('nan'):.3e} | {float(margin[i]):.3e} | "
                  f"{'yes' if flip else 'no'} | {desc}")
        early = sorted({d["position"] for d in own if d["position"] < P - 1})
        if early:
            print(f"   (prompt positions with differing decisions: {early})")


if __name__ == "__main__":
    main()
