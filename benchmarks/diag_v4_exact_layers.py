"""Bisect the fast V4 model (CPU) against the "blocks" reference per layer and block, prefill + decode.

python benchmarks/diag_v4_exact_layers.py [prompt index] [decode steps]
Prints, per position, the relative difference of each layer's attention output, MoE input and MoE output.
"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from megamoe.kvcache import DecodeBatch
from megamoe.models import decoder as D
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as R

cfg = V4_TINY_MODEL.replace(index_topk=64)
prompts = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [400, 401, 402]]
prompt = prompts[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
sd = random_state_dict(cfg, seed=1234)
w = {n: decoded_weight(sd, n) for n in weight_specs(cfg)}
want = R.greedy_generate(cfg, w, prompt, steps, numerics="blocks")
seq = torch.tensor(prompt + want[:-1])

rec = {}
orig = D.V4DecoderLayer.forward


def forward(self, h, attend, token_ids, timer=None):
    def att(x):
        y = attend(x)
        rec.setdefault((self.layer, "attn_in"), []).append(x.clone())
        rec.setdefault((self.layer, "attn"), []).append(y.clone())
        return y
    moe = self.moe.forward

    def moe_fwd(x, token_ids=None):
        y = moe(x, token_ids=token_ids)
        rec.setdefault((self.layer, "ffn_in"), []).append(x.clone())
        rec.setdefault((self.layer, "ffn_out"), []).append(y.clone())
        return y
    self.moe.forward = moe_fwd
    try:
        return orig(self, h, att, token_ids, timer)
    finally:
        del self.moe.forward


D.V4DecoderLayer.forward = forward
model = V4Model(cfg, max_batch=1, max_prefill_tokens=32, max_context=32 + steps + 1)
model.load_weights(sd)
model.prefill(0, torch.tensor(prompt))
batch = DecodeBatch.allocate(1, "cpu")
for t in want[:-1]:
    model.prepare_decode(batch, [0])
    model.decode(batch, torch.tensor([t]))

# reference trace over the whole sequence
h = w["embed.weight"][seq].to(torch.bfloat16).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
first = torch.arange(len(seq)) < (len(prompt) if len(prompt) > 16 else 0)
ref = {}
for layer in range(cfg.num_layers):
    tr = {}
    from megamoe.reference.v4_numerics import rms_norm
    x, _, _ = R._hc_pre(cfg, w, f"layers.{layer}.hc_attn", h)
    ref[(layer, "attn_in")] = rms_norm(x, w[f"layers.{layer}.attn_norm.weight"], cfg.norm_eps)
    h = R.block_forward(cfg, layer, w, h, seq, numerics="blocks", trace=tr, shared_first=first)
    ref[(layer, "attn")] = tr["attn"]["out"]
    ref[(layer, "ffn_in")], ref[(layer, "ffn_out")] = tr["ffn_in"], tr["ffn_out"]


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


P = len(prompt)
for key in sorted(rec):
    got = torch.cat(rec[key])
    r = ref[key]
    per = [rel(got[:P], r[:P])] + [rel(got[i:i + 1], r[i:i + 1]) for i in range(P, len(seq))]
    print(key, " ".join(f"{v:.0e}" for v in per))
