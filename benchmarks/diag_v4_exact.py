"""Fast V4 model (CPU, op references) vs the "blocks" reference model: teacher-forced logits per step.

[EXACT=0] [SEEDS=1,2] python benchmarks/diag_v4_exact.py [dense|sparse] [numerics] [steps]
"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from megamoe.reference.v4_model import exact_cpu_products
from megamoe.kvcache import DecodeBatch
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as R

sel = sys.argv[1] if len(sys.argv) > 1 else "dense"
numerics = sys.argv[2] if len(sys.argv) > 2 else "blocks"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 64
if os.environ.get("EXACT", "1") == "1":  # EXACT=0: the BLAS float32 products as they are
    exact_cpu_products().__enter__()
cfg = V4_TINY_MODEL.replace(index_topk=64) if sel == "dense" else V4_TINY_MODEL
prompts = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [400, 401, 402]]
for seed in [int(a) for a in os.environ.get("SEEDS", "1234").split(",")]:
    sd = random_state_dict(cfg, seed=seed)
    w = {n: decoded_weight(sd, n) for n in weight_specs(cfg)}
    model = V4Model(cfg, max_batch=1, max_prefill_tokens=32, max_context=32 + steps + 1)
    model.load_weights(sd)
    for slot, prompt in enumerate(prompts):
        want = R.greedy_generate(cfg, w, prompt, steps, numerics=numerics)
        ref = R.model_forward(cfg, w, torch.tensor(prompt + want[:-1]), numerics=numerics,
                              prefill_tokens=len(prompt))[len(prompt) - 1:]
        rows = [model.prefill(0, torch.tensor(prompt))]
        batch = DecodeBatch.allocate(1, "cpu")
        for t in want[:-1]:
            model.prepare_decode(batch, [0])
            rows.append(model.decode(batch, torch.tensor([t]))[0].clone())
        got = torch.stack(rows)
        rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
        print(" ".join(f"{v:.0e}" for v in rel.tolist()))
        agree = float((got.argmax(1) == torch.tensor(want)).float().mean())
        top2 = ref.topk(2, dim=1).values
        print(f"seed {seed} prompt {slot}: prefill rel {rel[0]:.2e} bitwise {torch.equal(got[0], ref[0])}; "
              f"median {rel.median():.2e} max {rel.max():.2e} (step {int(rel.argmax())}); "
              f"tokens agree {agree:.0%}; min top-2 margin {float((top2[:, 0] - top2[:, 1]).min()):.2e}")
