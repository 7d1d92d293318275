"""Issue 9 bisection: fast V4 model prefill logits (tiny config, seed 1234, prompts 0/1 of the token test) vs the
"blocks" reference, with every op on its CPU reference except the ops named in KOPS, which run their Triton kernel
under the interpreter. KOPS=sparse_mqa_attention python benchmarks/diag_v4_kernel_bisect.py [dense|sparse]
MIRROR=1: the reference model's attention is the bf16-P mirror of
benchmarks/diag_v4_attn_bf16p.py (also: nvfp4_linear, nvfp4_grouped_mm, comma-separated; a name works if its dispatch lives in that op function)."""
import os, sys, inspect
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import megamoe
from megamoe.ops import gemm, moe, attention, hyper_connection, v4_elementwise, quantize, topk
from megamoe.kvcache import ops as kvops
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import decoded_weight, random_state_dict, weight_specs
from megamoe.reference import v4_model as R
from megamoe.reference import attention as RA
os.environ["TRITON_INTERPRET"] = "1"  # the kernel module must be imported for the interpreter
from megamoe.kernels import sparse_attention as KA  # noqa: E402
os.environ["TRITON_INTERPRET"] = "0"
import math
def mirror(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
           block_table, slots, entry_idx, out=None, block_n=16, num_splits=None, **_):
    kv, valid = RA.gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots, entry_idx)
    W, K = window_idx.shape[1], entry_idx.shape[1]
    c = float(softmax_scale) * math.log2(math.e)
    s = torch.einsum("nhd,njd->nhj", q.float(), kv) * c
    s = torch.where(valid[:, None, :], s, torch.full((), float("-inf")))
    N, H, _ = s.shape
    blocks = [(a, min(a + block_n, W)) for a in range(0, W, block_n)] + \
        [(W + a, W + min(a + block_n, K)) for a in range(0, K, block_n)]
    if num_splits is None:
        num_splits = KA.choose_num_splits(N, H, W, K, interpreter=block_n == KA.INTERPRETER_CONFIG["BLOCK_N"])[0]
    splits, per = KA.split_layout(len(blocks), num_splits)
    parts = []
    for sp in range(splits):  # each split: its own online softmax from m = -inf, as the kernel
        m = torch.full((N, H), float("-inf")); l = torch.zeros(N, H); acc = torch.zeros(N, H, kv.shape[-1])
        for a, b in blocks[sp * per:(sp + 1) * per]:
            sb = s[:, :, a:b]
            m_new = torch.maximum(m, sb.amax(-1))
            mu = torch.where(m_new == float("-inf"), torch.zeros(()), m_new)
            alpha = torch.exp2(m - mu); p = torch.exp2(sb - mu[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("nhj,njd->nhd", p.to(torch.bfloat16).float(), kv[:, a:b])
            m = m_new
        parts.append((m, l, acc))
    if splits == 1:
        m, l, acc = parts[0]
    else:  # the combine kernel: fixed order, float32
        m = torch.stack([q_[0] for q_ in parts]).amax(0)
        mu = torch.where(m == float("-inf"), torch.zeros(()), m)
        l = torch.zeros(N, H); acc = torch.zeros(N, H, kv.shape[-1])
        for m_s, l_s, a_s in parts:
            wgt = torch.exp2(m_s - mu); l = l + wgt * l_s; acc = acc + wgt[..., None] * a_s
    mu = torch.where(m == float("-inf"), torch.zeros(()), m)
    den = l + torch.exp2(attn_sink.float()[None] * math.log2(math.e) - mu)
    o = acc / den[..., None]
    return torch.where(valid.any(-1)[:, None, None], o, torch.zeros(())).to(torch.bfloat16)

if os.environ.get("MIRROR") == "1":  # the reference model's attention with the kernel's bf16 P (interpreter blocks)
    import megamoe.reference.v4_attention as RV
    RV.sparse_mqa_attention = mirror
KOPS = set(os.environ.get("KOPS", "").split(",")) - {""}
MODS = [gemm, moe, attention, hyper_connection, v4_elementwise, quantize, topk, kvops]
patched = {}
def wrap(fn):
    def w(*a, **k):
        os.environ["TRITON_INTERPRET"] = "1"
        try: return fn(*a, **k)
        finally: os.environ["TRITON_INTERPRET"] = "0"
    return w
for mod in MODS:
    for name, fn in list(vars(mod).items()):
        if inspect.isfunction(fn) and fn.__module__ == mod.__name__ and (name in KOPS or "all" in KOPS):
            patched[fn] = wrap(fn); setattr(mod, name, patched[fn])
for mname, mm in list(sys.modules.items()):
    if mname.startswith("megamoe") and mm is not None:
        for k, v in list(vars(mm).items()):
            if inspect.isfunction(v) and v in patched: setattr(mm, k, patched[v])
sel = sys.argv[1] if len(sys.argv) > 1 else "dense"
cfg = V4_TINY_MODEL.replace(index_topk=64) if sel == "dense" else V4_TINY_MODEL
prompts = [[5, 17, 300, 2, 9, 44, 101, 7, 7, 250, 3, 18, 64, 99, 12, 1, 4],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
sd = random_state_dict(cfg, seed=1234)
w = {n: decoded_weight(sd, n) for n in weight_specs(cfg)}
m = V4Model(cfg, max_batch=2, max_prefill_tokens=18, max_context=40, head_dtype=torch.float32)
m.load_weights(sd)
out = []
for s, p in enumerate(prompts):
    got = m.prefill(s, torch.tensor(p)).float()
    ref = R.model_forward(cfg, w, torch.tensor(p), numerics="blocks", prefill_tokens=len(p))[-1].float()
    out.append("p%d %.1e%s" % (s, float((got - ref).norm() / ref.norm()), "" if got.argmax() == ref.argmax() else " FLIP"))
print(sel, sorted(KOPS), *out)
