import os, sys, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megamoe.models.config import V4_TINY_MODEL as cfg0
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as R
from megamoe.reference.v4_attention import attention_forward
from megamoe.reference.v4_numerics import rms_norm, hc_post
cfg = cfg0.replace(index_topk=64)
dev = sys.argv[1]
prompt=torch.tensor([5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4]*3)
sd = random_state_dict(cfg, seed=1234, device=dev)
model = V4Model(cfg, max_batch=2, max_prefill_tokens=64, max_context=128, device=dev, head_dtype=torch.float32)
model.load_weights(sd)
w = {n: decoded_weight({k: v.cpu() for k, v in sd.items()}, n) for n in weight_specs(cfg)}
def rel(a,b): a=a.float().cpu(); b=b.float().cpu(); return ((a-b).norm()/b.norm()).item()
h = w["embed.weight"][prompt].to(torch.bfloat16).unsqueeze(1).repeat(1,4,1)
model.join(0)
for L in model.layers: L.attn.prepare([0],[0],[len(prompt)])
for i, L in enumerate(model.layers):
    p=f"layers.{i}."
    x, post, comb = R._hc_pre(cfg, w, p+"hc_attn", h)
    xn = rms_norm(x, w[p+"attn_norm.weight"], cfg.norm_eps)
    ref_a = attention_forward(cfg, i, w, xn)
    fast_a = L.attn.forward_prefill(0, xn.to(dev)).clone()
    # decode path: slot 1 prefills all but the last 8 tokens, then decodes them one at a time
    from megamoe.kvcache import DecodeBatch
    T0 = len(prompt) - 8
    L.attn.join(1)
    L.attn.prepare([1], [0], [T0])
    L.attn.forward_prefill(1, xn[:T0].to(dev))
    batch = DecodeBatch.allocate(1, dev)
    dec = []
    for k in range(T0, len(prompt)):
        L.attn.prepare([1], [k], [k + 1])
        batch.set([1], [k], [True])
        dec.append(L.attn.forward_decode(batch, xn[k:k + 1].to(dev)).clone())
    dec_rel = rel(torch.cat(dec), ref_a["out"][T0:])
    h2 = hc_post(ref_a["out"].to(torch.bfloat16), h, post, comb)
    x, post, comb = R._hc_pre(cfg, w, p+"hc_ffn", h2)
    xn = rms_norm(x, w[p+"ffn_norm.weight"], cfg.norm_eps)
    ref_m = R.moe_block_forward(cfg, i, w, xn, prompt)
    fast_m = L.moe.forward(xn.to(dev), token_ids=prompt.to(dev)) if L.hashed else L.moe.forward(xn.to(dev))
    fast_m = fast_m.clone()
    rows = [L.moe.forward(xn[k:k + 1].to(dev), token_ids=prompt[k:k + 1].to(dev)).clone() if L.hashed
            else L.moe.forward(xn[k:k + 1].to(dev)).clone() for k in range(8)]
    print(dev, i, L.attn.kind, "attn rel %.2e" % rel(fast_a, ref_a["out"]), "decode attn rel %.2e" % dec_rel, "moe rel %.2e" % rel(fast_m, ref_m),
          "moe 1-token rel %.2e" % rel(torch.cat(rows), ref_m[:8]))
    h = hc_post(ref_m, h2, post, comb)
