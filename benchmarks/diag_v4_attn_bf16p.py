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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bf16p_attention import mirror  # noqa: E402
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import random_state_dict

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
