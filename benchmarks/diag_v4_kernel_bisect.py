"""Issue 9 bisection: fast V4 model prefill logits (tiny config, seed 1234, prompts 0/1 of the token test) vs the
"blocks" reference, with every op on its CPU reference except the ops named in KOPS, which run their Triton kernel
under the interpreter. KOPS=sparse_mqa_attention python benchmarks/diag_v4_kernel_bisect.py [dense|sparse]
MIRROR=1: the reference model's attention with the kernel's bf16 P (model_forward's
attention_p_rounding="kernel", interpreter tiles) (KOPS also: nvfp4_linear, nvfp4_grouped_mm, comma-separated; a name works if its dispatch lives in that op function)."""
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
MIRROR = dict(attention_p_rounding="kernel", max_context=40, decode_batch=2) if os.environ.get("MIRROR") == "1" else {}
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
    ref = R.model_forward(cfg, w, torch.tensor(p), numerics="blocks", prefill_tokens=len(p), **MIRROR)[-1].float()
    out.append("p%d %.1e%s" % (s, float((got - ref).norm() / ref.norm()), "" if got.argmax() == ref.argmax() else " FLIP"))
print(sel, sorted(KOPS), *out)
