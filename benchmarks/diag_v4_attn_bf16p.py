"""Issue 9: per call of the attention in one tiny-model prefill (prompt 1 of the token test, 18 tokens), the kernel
(CUDA when present, else the interpreter) vs the float32-P reference vs a blockwise bf16-P mirror of the kernel
(the device's BLOCK_N, 32 on CUDA / 16 interpreted, its split-KV partition and combine).
python benchmarks/diag_v4_attn_bf16p.py [dense|sparse]"""
import os, sys, math
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
os.environ["TRITON_INTERPRET"] = "0" if DEV == "cuda" else "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from megamoe.reference import attention as RA
from megamoe.kernels import sparse_attention as KA
import megamoe.layers.attention as LA
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import random_state_dict

def mirror(q, attn_sink, softmax_scale, *, window_kv, window_idx, entries_fp8, entries_scale, entries_rope,
           block_table, slots, entry_idx, out=None, block_n=None, num_splits=None, **_):
    interp = not q.is_cuda
    dv = q.device
    if block_n is None:
        block_n = (KA.INTERPRETER_CONFIG if interp else KA.ATTENTION_CONFIG)["BLOCK_N"]
    kv, valid = RA.gather_rows(window_kv, window_idx, entries_fp8, entries_scale, entries_rope, block_table, slots, entry_idx)
    W, K = window_idx.shape[1], entry_idx.shape[1]
    c = float(softmax_scale) * math.log2(math.e)
    s = torch.einsum("nhd,njd->nhj", q.float(), kv) * c
    s = torch.where(valid[:, None, :], s, torch.full((), float("-inf"), device=dv))
    N, H, _ = s.shape
    blocks = [(a, min(a + block_n, W)) for a in range(0, W, block_n)] + \
        [(W + a, W + min(a + block_n, K)) for a in range(0, K, block_n)]
    if num_splits is None:
        num_splits = KA.choose_num_splits(N, H, W, K, interpreter=interp)[0]
    splits, per = KA.split_layout(len(blocks), num_splits)
    parts = []
    for sp in range(splits):  # each split: its own online softmax from m = -inf, as the kernel
        m = torch.full((N, H), float("-inf"), device=dv); l = torch.zeros(N, H, device=dv); acc = torch.zeros(N, H, kv.shape[-1], device=dv)
        for a, b in blocks[sp * per:(sp + 1) * per]:
            sb = s[:, :, a:b]
            m_new = torch.maximum(m, sb.amax(-1))
            mu = torch.where(m_new == float("-inf"), torch.zeros((), device=dv), m_new)
            alpha = torch.exp2(m - mu); p = torch.exp2(sb - mu[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("nhj,njd->nhd", p.to(torch.bfloat16).float(), kv[:, a:b])
            m = m_new
        parts.append((m, l, acc))
    if splits == 1:
        m, l, acc = parts[0]
    else:  # the combine kernel: fixed order, float32
        m = torch.stack([q_[0] for q_ in parts]).amax(0)
        mu = torch.where(m == float("-inf"), torch.zeros((), device=dv), m)
        l = torch.zeros(N, H, device=dv); acc = torch.zeros(N, H, kv.shape[-1], device=dv)
        for m_s, l_s, a_s in parts:
            wgt = torch.exp2(m_s - mu); l = l + wgt * l_s; acc = acc + wgt[..., None] * a_s
    mu = torch.where(m == float("-inf"), torch.zeros((), device=dv), m)
    den = l + torch.exp2(attn_sink.float()[None] * math.log2(math.e) - mu)
    o = acc / den[..., None]
    return torch.where(valid.any(-1)[:, None, None], o, torch.zeros((), device=dv)).to(torch.bfloat16)

f = LA.sparse_mqa_attention
RA_KW = ('window_kv', 'window_idx', 'entries_fp8', 'entries_scale', 'entries_rope', 'block_table', 'slots',
         'entry_idx')
def w(*a, **k):
    o = f(*a, **k).clone()
    r = RA.sparse_mqa_attention(*a, **{kk: v for kk, v in k.items() if kk in RA_KW})
    mi = mirror(*a, **k)
    rel = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())
    sp = KA.choose_num_splits(a[0].shape[0], a[0].shape[1], k["window_idx"].shape[1], k["entry_idx"].shape[1], interpreter=DEV == "cpu")
    print("attn call N=%d W=%d K=%d splits=%s: kernel vs f32-P ref %.2e, kernel vs bf16-P mirror %.2e, mirror vs ref %.2e" % (
        a[0].shape[0], k["window_idx"].shape[1], k["entry_idx"].shape[1], sp, rel(o, r), rel(o, mi), rel(mi, r)))
    return o
LA.sparse_mqa_attention = w
sel = sys.argv[1] if len(sys.argv) > 1 else "dense"
cfg = V4_TINY_MODEL.replace(index_topk=64) if sel == "dense" else V4_TINY_MODEL
sd = random_state_dict(cfg, seed=1234)
m = V4Model(cfg, max_batch=1, max_prefill_tokens=18, max_context=40, head_dtype=torch.float32, device=DEV)
m.load_weights({k: v.to(DEV) for k, v in sd.items()})
m.prefill(0, torch.tensor(list(range(1, 19)), device=DEV))
