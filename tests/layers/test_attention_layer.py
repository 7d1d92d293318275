"""The V4 attention block with its fused elementwise ops (megamoe.ops.v4_elementwise) against the same block
running the ops' PyTorch formulas: intermediates (q, kv, indexer query / weights, grouped output) bit-exact up to
the stated float32 summation-order effects, and identical layer outputs when the intermediates are identical.

CPU: the fused ops run through the interpreter (the other ops on their references); CUDA: every layer kind at
V4-Flash dims, decode and prefill.
"""
import pytest
import torch

from megamoe.kvcache import DecodeBatch
from megamoe.layers.attention import Nvfp4Attention
from megamoe.models.config import V4_FLASH_MODEL, V4_TINY_MODEL
from megamoe.models.decoder import attention_weights
from megamoe.models.v4_weights import random_state_dict
from megamoe.ops import v4_elementwise as ew
# Imported now, while conftest's TRITON_INTERPRET=1 holds (the CPU test switches the variable off so that the
# other ops run their references; the interpreter imports gluon lazily and needs the variable at that moment).
import megamoe.kernels.v4_elementwise  # noqa: E402,F401
import triton.experimental.gluon  # noqa: E402,F401
from guard_helpers import require_interpreter  # tests/guard_helpers.py (tests/ is on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPS = ("rms_norm", "q_kv_path", "index_q_path", "output_path")
_ORIGINAL = {name: getattr(ew, name) for name in OPS}


def _run(cfg, layer, device, monkeypatch, fused: bool, prompt_len: int, steps: int):
    """Prefill + decode steps of one layer; returns (outputs, {op name: [outputs of each call]})."""
    calls = {name: [] for name in OPS}
    for name in OPS:
        fn = _ORIGINAL[name]

        def wrapped(*a, _fn=fn, _name=name, **k):
            out = _fn(*a, **k)
            calls[_name].append(tuple(t.clone() for t in (out if isinstance(out, tuple) else (out,))))
            return out

        monkeypatch.setattr(ew, name, wrapped)
    monkeypatch.setattr(ew, "use_triton", (lambda t: True) if fused else (lambda t: False))
    sd = random_state_dict(cfg, seed=3, device=device, layers=[layer], select=lambda n: ".attn." in n)
    att = Nvfp4Attention(cfg, layer, max_batch=2, max_prefill_tokens=prompt_len, max_slots=2,
                         max_context=prompt_len + steps + 1, device=device)
    att.load_weights(attention_weights(sd, cfg, layer))
    g = torch.Generator(device="cpu").manual_seed(11)
    x = (torch.randn(prompt_len + steps, 2, cfg.hidden_size, generator=g)).to(torch.bfloat16).to(device)
    outs = []
    for slot in range(2):
        att.join(slot)
        att.prepare([slot], [0], [prompt_len])
        outs.append(att.forward_prefill(slot, x[:prompt_len, slot].contiguous()))
    batch = DecodeBatch.allocate(2, device)
    for s in range(steps):
        p = prompt_len + s
        att.prepare([0, 1], [p, p], [p + 1, p + 1])
        batch.set([0, 1], [p, p], [True, True])
        outs.append(att.forward_decode(batch, x[p].contiguous()))
    return outs, calls


def _compare_runs(fused, plain, max_fraction):
    (out_f, calls_f), (out_p, calls_p) = fused, plain
    identical = True
    for name in OPS:
        assert len(calls_f[name]) == len(calls_p[name]), name
        for cf, cp in zip(calls_f[name], calls_p[name]):
            for a, b in zip(cf, cp):
                a, b = a.cpu(), b.cpu()
                assert a.shape == b.shape and a.dtype == b.dtype
                bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
                n = int((a.view(bits) != b.view(bits)).sum())
                assert max_fraction is None or n <= max_fraction * a.numel(), (
                    f"{name}: {n} of {a.numel()} elements differ")
                identical &= n == 0
    for a, b in zip(out_f, out_p):
        a, b = a.float().cpu(), b.float().cpu()
        if identical:
            assert torch.equal(a, b)
        else:  # a summation-order flip upstream: the block output moves a little
            assert float((a - b).norm() / b.norm()) < 2e-2
    return identical


@pytest.mark.parametrize("layer", [0, 1, 2])  # window, CSA (indexer), HCA
def test_fused_layer_equals_formulas_cpu(monkeypatch, layer):
    require_interpreter()  # our fused kernels, forced below, run on CPU tensors through the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the other ops run their references; ours are forced below
    cfg = V4_TINY_MODEL
    fused = _run(cfg, layer, torch.device("cpu"), monkeypatch, True, prompt_len=17, steps=3)
    plain = _run(cfg, layer, torch.device("cpu"), monkeypatch, False, prompt_len=17, steps=3)
    assert all(len(c) for n, c in fused[1].items() if n != "index_q_path" or cfg.layer_kind(layer) == "csa")
    _compare_runs(fused, plain, max_fraction=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("layer", [0, 2, 3])  # V4-Flash: window, CSA, HCA (ratio 128)
def test_fused_layer_equals_formulas_cuda_v4_flash(monkeypatch, layer):
    """Fused kernels vs the same formulas on CUDA (cuBLAS / torch ops): the norms use the same rsqrt instruction;
    PyTorch's CUDA complex multiply may be FMA-contracted, so a small fraction of RoPE'd elements may differ by
    one bf16 ulp (then an FP8/FP4 code downstream)."""
    cfg = V4_FLASH_MODEL
    dev = torch.device("cuda")
    fused = _run(cfg, layer, dev, monkeypatch, True, prompt_len=130, steps=4)
    plain = _run(cfg, layer, dev, monkeypatch, False, prompt_len=130, steps=4)
    # measured on an H200: 6.3% of the q elements of the CSA layer differ (one bf16 rounding of the op-by-op
    # per-head norm, or an FMA-contracted complex multiply in torch's CUDA path), and every later op then sees
    # other inputs (22% of output_path's elements differ), so no per-op count holds on CUDA; the block outputs
    # must stay within the 2e-2 bound of _compare_runs (the kernels' exactness on equal inputs is tested in
    # tests/kernels/test_v4_elementwise.py)
    identical = _compare_runs(fused, plain, max_fraction=None)
    print(f"layer {layer}: intermediates identical: {identical}")
