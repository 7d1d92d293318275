"""Issue 9: the whole tiny V4 model with the Triton kernels under the interpreter (CPU), free-running greedy over
the token test's prompts decoded as one batch, against the "blocks" reference with the attention kernel's bf16 P
(``attention_p_rounding="kernel"``, teacher-forced on the fast tokens), and the reference's top-2 margins.
python benchmarks/diag_v4_interp_tokens.py [dense|sparse] [steps] [peaked]   (peaked: tests/models' peaked weights)"""
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
import torch  # noqa: E402

import test_v4_model as T  # noqa: E402  (the token test's prompts, model set-up and free-running loop)
from megamoe.reference import v4_model as R  # noqa: E402

sel = sys.argv[1] if len(sys.argv) > 1 else "dense"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else T.STEPS
peaked = len(sys.argv) > 3 and sys.argv[3] == "peaked"
cfg = T._config(sel)
t0 = time.time()
res = T.compare_with_reference(cfg, torch.device("cpu"), T.PROMPTS, steps, attention_p_rounding="kernel",
                               peaked=peaked)
print(f"{sel} steps={steps} peaked={peaked} ({time.time() - t0:.0f} s)")
margins = []
for r, d in enumerate(res):
    margins.append(d["margins"])
    print(f"prompt {r}: diverging steps {d['diverged']}, logits rel err max {float(d['rel'].max()):.2e} median "
          f"{float(d['rel'].median()):.2e}, abs err max {float(d['abs'].max()):.2e}; ref top-2 margin min "
          f"{float(d['margins'].min()):.2e}, logits std {float(d['std'].mean()):.2e}")
m = torch.cat(margins)
print("reference top-2 margins over all steps: " + ", ".join(
    f"<{t:g}: {int((m < t).sum())}" for t in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)) + f" of {m.numel()}; quantiles 1/5/50%: "
      + " ".join(f"{float(m.quantile(q)):.2e}" for q in (0.01, 0.05, 0.5)))
