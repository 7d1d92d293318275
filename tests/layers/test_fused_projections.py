"""The attention block's fused projections (``megamoe.layers.linear.FusedLinear``) against the separate ones.

``Nvfp4Attention.load_weights`` row-concatenates the projections that read the same input: ``wq_a | wkv`` (x,
NVFP4), ``wq_b | indexer.wq_b`` (qr, NVFP4, CSA layers), ``compressor.wkv | compressor.wgate | indexer.compressor.wkv
| indexer.compressor.wgate`` (x.float(), float32). Each output element is the separate projection's dot product;
only the float32 summation order may change (the GEMM routes pick split-K counts / tiles from N), so the fused
outputs must equal the separate ones up to that: a bf16 output within one rounding step, a float32 one within
float32 summation noise. A wrong split (swapped parts, a split point off by one row) moves whole columns and
fails these bounds by orders of magnitude.

Also: the kernels that read the column views (``v4_elementwise`` ops, the compressor step) give the same bits
for a strided view as for a contiguous copy, and prefill and decode run the fused projections only.
"""
import importlib

import pytest
import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.kvcache import DecodeBatch
from megamoe.kvcache import ops as kv_ops
from megamoe.kvcache.state import CompressorState
from megamoe.layers import linear as linear_mod
from megamoe.layers.attention import Nvfp4Attention
from megamoe.layers.linear import DenseLinear, FusedLinear, concat_rows, row_slice
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.decoder import attention_weights
from megamoe.models.v4_weights import random_state_dict
from megamoe.ops import v4_elementwise as ew
from megamoe.reference.quantize import dequantize, quantize

# Imported now, while conftest's TRITON_INTERPRET=1 holds (tests below switch the variable off so that the ops run
# their references; the interpreter imports gluon lazily and needs the variable at that moment).
importlib.import_module("megamoe.kernels.v4_elementwise")
importlib.import_module("triton.experimental.gluon")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CFG = V4_TINY_MODEL.replace(max_seq_len=256)
FAMILIES = {  # fused attribute -> official names of its parts, in row order
    "x_proj": ("wq_a", "wkv"),
    "qr_proj": ("wq_b", "indexer.wq_b"),
    "comp_proj": ("compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate"),
}


@pytest.fixture
def torch_path(monkeypatch):
    """The ops' PyTorch references (no interpreter): fast, and the GEMM is the exact-decode reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _close(fused: torch.Tensor, separate: torch.Tensor, name: str) -> None:
    bf16 = separate.dtype == torch.bfloat16
    assert fused.shape == separate.shape and fused.dtype == separate.dtype, name
    a, b = fused.float(), separate.float()
    scale = float(b.abs().max())
    tol = (2.0 ** -7 * b.abs() + 1e-3 * scale) if bf16 else (1e-5 * scale + 1e-6 * b.abs())
    bad = (a - b).abs() > tol
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {a.numel()} elements differ beyond summation order, "
                           f"max |diff| {float((a - b).abs().max()):.3g} (scale {scale:.3g})")


def _weights(kind: str, sizes, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        w = torch.randn(n, k, generator=g) * k ** -0.5 * (1 + i)  # different magnitudes: different global scales
        out.append(quantize(w) if kind == "nvfp4" else w.to(getattr(torch, kind)))
    return out


# ------------------------------------------------------------------------------------------------ FusedLinear
def test_concat_rows_nvfp4_scales():
    a, b = _weights("nvfp4", (48, 32), 64)
    assert a.global_scale.dim() == 0 and float(a.global_scale) != float(b.global_scale)
    cat = concat_rows([a, b])
    assert tuple(cat.shape) == (80, 64) and tuple(cat.global_scale.shape) == (80, 1)
    assert torch.equal(cat.global_scale[:48, 0], a.global_scale.expand(48))
    assert torch.equal(cat.global_scale[48:, 0], b.global_scale.expand(32))
    assert torch.equal(dequantize(cat, torch.float32), torch.cat([dequantize(a, torch.float32),
                                                                  dequantize(b, torch.float32)]))
    same = NVFP4Tensor(b.data, b.block_scale, a.global_scale.clone(), b.shape)
    assert concat_rows([a, same]).global_scale.dim() == 0  # equal per-tensor scales stay one scale
    part = row_slice(cat, 48, 80)
    assert torch.equal(dequantize(part, torch.float32), dequantize(b, torch.float32))
    with pytest.raises(ValueError, match="one kind"):
        concat_rows([a, torch.randn(8, 64)])


@pytest.mark.parametrize("backend", ["torch", "interpreter"])
@pytest.mark.parametrize("kind", ["nvfp4", "float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_linear_equals_separate(monkeypatch, backend, kind, rows):
    if backend == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif kind != "nvfp4":
        pytest.skip("dense weights run torch.matmul on either backend")
    sizes, k = (64, 48, 16), 128
    ws = _weights(kind, sizes, k, seed=rows)
    fused = FusedLinear([(f"p{i}", w) for i, w in enumerate(ws)])
    assert fused.fused and fused.sizes == sizes and fused.out_features == sum(sizes)
    x = torch.randn(rows, k).to(torch.bfloat16)
    outs = fused(x)
    assert len(outs) == len(sizes)
    base = outs[0].untyped_storage().data_ptr()
    for i, (o, w) in enumerate(zip(outs, ws)):
        assert o.untyped_storage().data_ptr() == base  # views of one GEMM output, no copies
        assert o.stride(-1) == 1
        _close(o, DenseLinear(w, name=f"p{i}")(x), f"{kind} p{i}")
        _close(fused.part(f"p{i}")(x), DenseLinear(w)(x), f"{kind} part p{i}")
    assert fused.nbytes() == sum(DenseLinear(w).nbytes() for w in ws) + (
        4 * (sum(sizes) - len(sizes)) if kind == "nvfp4" else 0)  # per-row global scales replace per-tensor ones


def test_fused_linear_mixed_kinds_run_separately(torch_path):
    a = _weights("nvfp4", (32,), 64)[0]
    b = torch.randn(16, 64).to(torch.bfloat16)
    fused = FusedLinear([("a", a), ("b", b)])
    assert not fused.fused
    x = torch.randn(3, 64).to(torch.bfloat16)
    ya, yb = fused(x)
    assert torch.equal(ya, DenseLinear(a)(x)) and torch.equal(yb, DenseLinear(b)(x))
    with pytest.raises(ValueError, match=r"wq_a\+wkv: the parts read one input"):
        FusedLinear([("wq_a", torch.randn(8, 64)), ("wkv", torch.randn(8, 32))])


# ------------------------------------------------------------------------------------------------ the layer
def _layer(layer: int, max_batch: int = 2, prompt: int = 9):
    sd = random_state_dict(CFG, seed=7, layers=[layer], select=lambda n: ".attn." in n)
    w = attention_weights(sd, CFG, layer)
    att = Nvfp4Attention(CFG, layer, max_batch=max_batch, max_prefill_tokens=prompt, max_slots=2,
                         max_context=prompt + 8, device="cpu")
    att.load_weights(w)
    return att, w


def _separate(w, layer: int, family: str):
    names = [n for n in FAMILIES[family] if CFG.layer_kind(layer) == "csa" or not n.startswith("indexer.")]
    if family == "comp_proj":  # bf16 checkpoint weights, float32 results (the official float32 linears)
        return names, [DenseLinear(w[n + ".weight"], name=n, out_dtype=torch.float32) for n in names]
    return names, [DenseLinear(w[n + ".weight"], name=n) for n in names]


@pytest.mark.parametrize("layer", [0, 1, 2])  # window, CSA (indexer), HCA
def test_layer_fused_projections_equal_separate(torch_path, layer):
    att, w = _layer(layer)
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(5, CFG.hidden_size, generator=g).to(torch.bfloat16)
    qr = torch.randn(5, CFG.q_lora_rank, generator=g).to(torch.bfloat16)
    inputs = {"x_proj": x, "qr_proj": qr, "comp_proj": x}
    for family in ("x_proj", "qr_proj", "comp_proj"):
        fused = getattr(att, family)
        if CFG.layer_kind(layer) == "window" and family == "comp_proj":
            assert fused is None
            continue
        names, separate = _separate(w, layer, family)
        assert fused.names == tuple(names) and fused.fused, family
        outs = fused(inputs[family])
        assert len(outs) == len(separate)
        for n, o, lin in zip(names, outs, separate):
            _close(o, lin(inputs[family]), f"layer {layer} {family}: {n}")
            if family == "comp_proj":  # the official float32 linear on the same values
                assert o.dtype == torch.float32
                _close(o, DenseLinear(w[n + ".weight"].float())(x.float()), f"layer {layer} {family}: {n} (fp32)")
    # the former attributes are the parts' rows of the fused weights (views)
    for n, attr in (("wq_a", "wq_a"), ("wkv", "wkv"), ("wq_b", "wq_b")):
        inp = qr if n == "wq_b" else x
        _close(getattr(att, attr)(inp), DenseLinear(w[n + ".weight"])(inp), attr)
    # memory accounting: every projection once, the fused global scales per row
    expect = sum(DenseLinear(w[n + ".weight"]).nbytes() for n in ("wq_a", "wkv", "wq_b", "wo_b", "wo_a"))
    for fused in (att.x_proj, att.qr_proj):  # random weights: every part has its own per-tensor global scale
        expect += 4 * (fused.out_features - len(fused.names)) if len(fused.names) > 1 else 0
    if att.comp_proj is not None:
        expect += sum(lin.nbytes() for lin in _separate(w, layer, "comp_proj")[1])
    if CFG.layer_kind(layer) == "csa":
        expect += DenseLinear(w["indexer.wq_b.weight"]).nbytes() + att.i_weights.nbytes()
    assert att.weight_bytes() == expect


class _Unfused:
    """A family run as separate projections on the checkpoint's own weights (the layer before fusion)."""

    def __init__(self, linears):
        self.linears = linears

    def __call__(self, x):
        return tuple(lin(x) for lin in self.linears)


def _run(att, x, prompt: int, steps: int):
    outs = []
    for slot in range(2):
        att.join(slot)
        att.prepare([slot], [0], [prompt])
        outs.append(att.forward_prefill(slot, x[:prompt, slot].contiguous()))
    batch = DecodeBatch.allocate(2, "cpu")
    for s in range(steps):
        p = prompt + s
        att.prepare([0, 1], [p, p], [p + 1, p + 1])
        batch.set([0, 1], [p, p], [True, True])
        outs.append(att.forward_decode(batch, x[p].contiguous()))
    return outs


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_prefill_and_decode_run_the_fused_projections(torch_path, monkeypatch, layer):
    prompt, steps = 9, 6
    x = torch.randn(prompt + steps, 2, CFG.hidden_size).to(torch.bfloat16)
    unfused, w = _layer(layer, prompt=prompt)
    for family in FAMILIES:
        if getattr(unfused, family) is not None:
            setattr(unfused, family, _Unfused(_separate(w, layer, family)[1]))
    ref = _run(unfused, x, prompt, steps)

    att, _ = _layer(layer, prompt=prompt)
    calls = []
    original = DenseLinear.__call__
    monkeypatch.setattr(linear_mod.DenseLinear, "__call__",
                        lambda self, *a, **k: (calls.append(self.name), original(self, *a, **k))[1])
    outs = _run(att, x, prompt, steps)
    fused = {att.x_proj.name, att.qr_proj.name} | ({att.comp_proj.name} if att.comp_proj is not None else set())
    extra = {"wo_b"} | ({"indexer.weights_proj"} if CFG.layer_kind(layer) == "csa" else set())
    assert set(calls) == fused | extra
    for name in fused:  # once per prefill (2) and per decode step
        assert calls.count(name) == 2 + steps, name
    # same layer outputs up to summation order upstream (bf16 outputs; the attention and the top-k see the same
    # projections within one rounding)
    for i, (a, b) in enumerate(zip(outs, ref)):
        err = float((a.float() - b.float()).norm() / b.float().norm())
        assert err < 1e-2, (i, err)


# ------------------------------------------------------------------------------------------------ strided rows
def _strided(t: torch.Tensor, left: int = 3, right: int = 5) -> torch.Tensor:
    """t's values as a column view of a wider (rows, left + cols + right) tensor."""
    wide = torch.randn(t.shape[0], left + t.shape[1] + right).to(t.dtype).to(t.device)
    wide[:, left:left + t.shape[1]] = t
    view = wide[:, left:left + t.shape[1]]
    assert t.shape[0] < 2 or not view.is_contiguous()
    return view


@pytest.mark.parametrize("T", [1, 3])
def test_elementwise_kernels_read_strided_rows(device, T):
    """Kernels (CUDA, or the interpreter): a column view gives the bits of its contiguous copy (rms_norm,
    q_kv_path, index_q_path)."""
    H, D, NH, DI, rd = 2, 128, 4, 64, 64
    freqs = torch.polar(torch.ones(32, rd // 2), torch.rand(32, rd // 2)).to(device)
    pos = torch.randint(0, 32, (T,), dtype=torch.int32).to(device)
    x = torch.randn(T, 96).to(torch.bfloat16).to(device)
    w = (torch.rand(96) + 0.5).to(device)
    assert torch.equal(ew.rms_norm(_strided(x), w, 1e-6), ew.rms_norm(x, w, 1e-6))
    q, kv = torch.randn(T, H * D).to(torch.bfloat16).to(device), torch.randn(T, D).to(torch.bfloat16).to(device)
    kw = (torch.rand(D) + 0.5).to(device)
    a = ew.q_kv_path(_strided(q), _strided(kv, 7, 1), kw, freqs, pos, num_heads=H, eps=1e-6)
    b = ew.q_kv_path(q, kv, kw, freqs, pos, num_heads=H, eps=1e-6)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    iq, iw = torch.randn(T, NH * DI).to(torch.bfloat16).to(device), torch.randn(T, NH).to(torch.bfloat16).to(device)
    a = ew.index_q_path(_strided(iq), _strided(iw, 2, 2), freqs, pos, n_heads=NH, weight_scale=0.3)
    b = ew.index_q_path(iq, iw, freqs, pos, n_heads=NH, weight_scale=0.3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("ratio,overlap,width", [(4, True, 64), (8, False, 32)])
def test_compressor_step_reads_strided_rows(device, ratio, overlap, width):
    """Kernel (CUDA, or the interpreter): the compressor step on column views of one wide output == on contiguous
    copies."""
    B, S, C = 3, 3, 2 if overlap else 1
    states = [CompressorState.allocate(S, ratio, width, overlap, device) for _ in range(2)]
    ape = torch.randn(ratio, C * width).to(device)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32).to(device)
    for step in range(2 * ratio + 1):
        wide = torch.randn(B, 2 * C * width + 16).to(device)
        kv, score = wide[:, :C * width], wide[:, C * width + 16:]
        p = torch.tensor([step, step + 1, step + 2], dtype=torch.int32).to(device)
        active = torch.tensor([True, True, step % 3 != 0]).to(device)
        outs = []
        for st, (k, z) in zip(states, ((kv, score), (kv.contiguous(), score.contiguous()))):
            pooled, flush = torch.zeros(B, width, device=device), torch.zeros(B, dtype=torch.bool, device=device)
            kv_ops.compressor_step(st, k, z, slots, p, active, pooled, flush, ape=ape)
            outs.append((pooled, flush))
        assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], outs[1][0])
        for name in ("tail_k", "tail_z", "tail_kb", "tail_zb", "tail_len"):
            a, b = getattr(states[0], name), getattr(states[1], name)
            if a is not None:
                assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="unit stride"):
        kv_ops.compressor_step(states[0], torch.randn(C * width, B, device=device).t(), score, slots, p, active,
                               torch.zeros(B, width, device=device), torch.zeros(B, dtype=torch.bool, device=device))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fused_projections_v4_flash_shapes_cuda(rows):
    """CUDA, V4-Flash shapes: the fused GEMMs (split-K routes chosen from the fused N, per-row global scales)
    against the separate ones, for x_proj (1024 + 512 rows, K 4096), qr_proj (32768 + 8192, K 1024) and the CSA
    comp_proj (1024 + 1024 + 256 + 256, K 4096; float32 weights, and bf16 weights with float32 results as the layer
    holds them) against the float32 linear."""
    from megamoe.models.config import V4_FLASH_MODEL as F

    dev = torch.device("cuda")
    dim, ql, D, Di = F.hidden_size, F.q_lora_rank, F.head_dim, F.index_head_dim
    families = [
        ("nvfp4", (ql, D), dim),
        ("nvfp4", (F.num_heads * D, F.index_n_heads * Di), ql),
        ("float32", (2 * D, 2 * D, 2 * Di, 2 * Di), dim),
        ("bfloat16", (2 * D, 2 * D, 2 * Di, 2 * Di), dim),  # the layer's comp_proj: bf16 weights, float32 results
    ]
    for kind, sizes, k in families:
        ws = [w.to(dev) for w in _weights(kind, sizes, k, seed=rows)]
        out_dtype = torch.float32 if kind == "bfloat16" else None
        fused = FusedLinear([(f"p{i}", w) for i, w in enumerate(ws)], out_dtype=out_dtype)
        x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
        outs = fused(x.float() if kind == "float32" else x)
        for i, (o, w) in enumerate(zip(outs, ws)):
            ref = DenseLinear(w.float() if out_dtype else w)(x.float() if kind != "nvfp4" else x)
            _close(o, ref, f"{kind} {sizes} p{i} rows {rows}")


@pytest.mark.parametrize("kind", ["nvfp4", "bf16", "fp32"])
def test_dense_linear_call_validates_x_and_out(kind, torch_path):
    """x is a 2-D float tensor with ``in_features`` columns; ``out`` is (M, out_features) of the result dtype (bf16
    for NVFP4 / bf16 weights, float32 for float32 ones): a wrong one raises instead of broadcasting or casting."""
    w = torch.randn(32, 64)
    lin = DenseLinear({"nvfp4": quantize(w), "bf16": w.bfloat16(), "fp32": w}[kind])
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(1, 64).to(dtype)
    assert lin(x).shape == (1, 32)
    with pytest.raises(TypeError, match="x"):
        lin([1.0] * 64)
    with pytest.raises(TypeError, match="x"):
        lin(torch.zeros(1, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        lin(torch.randn(64).to(dtype))
    with pytest.raises(ValueError, match="x"):
        lin(torch.randn(1, 48).to(dtype))
    with pytest.raises(ValueError, match="out"):
        lin(x, out=torch.empty(4, 32, dtype=dtype))
    with pytest.raises(TypeError, match="out"):
        lin(x, out=torch.empty(1, 32, dtype=torch.int32))
    out = torch.empty(1, 32, dtype=dtype)
    assert lin(x, out=out) is out
