"""Diagnostic: teacher-forced logits error of the fast V4 model (tiny config, dense selection) against the float
reference, on CUDA, with CPU-generated weights moved to the GPU, for a bf16 and a float32 head.

NUMERICS=blocks python benchmarks/diag_v4_model_gpu.py: against the "blocks" reference (the fast path's rounding
points) instead of the official numerics (default ``official_fp32_index``)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
import test_v4_model as T  # noqa: E402
from megamoe.models.config import V4_TINY_MODEL  # noqa: E402
from megamoe.models.model import V4Model  # noqa: E402
from megamoe.models.v4_weights import random_state_dict  # noqa: E402
from megamoe.reference import v4_model as R  # noqa: E402

NUMERICS = os.environ.get("NUMERICS", T.OFFICIAL_NUMERICS)
cfg = V4_TINY_MODEL.replace(index_topk=64)
prompt = [5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4]
for seed in (1, 2):
    sd = random_state_dict(cfg, seed=seed)
    w = T._decoded(cfg, sd)
    want = R.greedy_generate(cfg, w, prompt, 64, numerics=NUMERICS)
    ref = R.model_forward(cfg, w, torch.tensor(prompt + want[:-1]), numerics=NUMERICS,
                          prefill_tokens=len(prompt))[16:]
    for dev, head in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        m = V4Model(cfg, max_batch=1, max_prefill_tokens=17, max_context=17 + 65, device=dev, head_dtype=head)
        m.load_weights({k: v.to(dev) for k, v in sd.items()})
        got = T._teacher_forced(m, 0, prompt, want)
        rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
        print(seed, dev, head, "median %.3e jumps %.2f max %.3f agree %.2f" % (
            rel.median(), (rel > 0.05).float().mean(), rel.max(), (got.argmax(1) == torch.tensor(want)).float().mean()))
