"""Public GEMM ops: argument validation, the CPU reference path, the gate/up layout."""
import pytest
import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.ops import gemm as ops_gemm
from megamoe.ops.gemm import deinterleave_gate_up, interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear
from megamoe.reference import gemm as ref_gemm
from megamoe.reference.quantize import dequantize, quantize


def _weight(*shape):
    return quantize(torch.randn(*shape) * 0.05)


def test_interleave_layout_and_inverse():
    w = _weight(2, 8, 32)
    wi = interleave_gate_up(w)
    dense, dense_i = dequantize(w, torch.float32), dequantize(wi, torch.float32)
    assert torch.equal(dense_i[:, 0::2], dense[:, :4])  # gate rows
    assert torch.equal(dense_i[:, 1::2], dense[:, 4:])  # up rows
    back = deinterleave_gate_up(wi)
    assert torch.equal(back.data, w.data) and torch.equal(back.block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))


def test_interleave_per_row_global_scale_follows_rows():
    w = quantize(torch.randn(6, 16), per_row=True)  # global_scale (6, 1)
    wi = interleave_gate_up(w)
    assert torch.equal(dequantize(wi, torch.float32)[1::2], dequantize(w, torch.float32)[3:])


def test_reference_path_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = _weight(3, 16, 32)
    x = torch.randn(5, 32).bfloat16()
    offsets = torch.tensor([2, 2, 4], dtype=torch.int32)
    out = nvfp4_grouped_mm(x, w, offsets)
    expect = torch.zeros(5, 16)
    wf = dequantize(w, torch.float32)
    expect[0:2] = x[0:2].float() @ wf[0].t()
    expect[2:4] = x[2:4].float() @ wf[2].t()
    assert torch.equal(out, expect.bfloat16())
    lin = nvfp4_linear(x, NVFP4Tensor(w.data[1], w.block_scale[1], w.global_scale, (16, 32)))
    assert torch.equal(lin, (x.float() @ wf[1].t()).bfloat16())


def test_reference_w4a4_quantizes_activations_per_row():
    x = torch.randn(4, 32).bfloat16()
    xa = ref_gemm.activations_for_mode(x, "w4a4")
    assert torch.equal(xa, dequantize(quantize(x, per_row=True), torch.bfloat16))
    assert ref_gemm.activations_for_mode(x, "w4a16") is x


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        (dict(x=torch.randn(2, 32)), TypeError, "x: expected bfloat16"),
        (dict(x=torch.randn(2, 3, 32).bfloat16()), ValueError, "x: expected a 2-D"),
        (dict(x=torch.randn(2, 48).bfloat16()), ValueError, "K=32"),
        (dict(mode="w8a8"), ValueError, "mode"),
        (dict(out=torch.empty(2, 15, dtype=torch.bfloat16)), ValueError, "out: expected shape"),
        (dict(out=torch.empty(2, 16)), TypeError, "out: expected bfloat16"),
        (dict(bias=torch.randn(15)), ValueError, "bias: expected shape"),
        (dict(weight="w"), TypeError, "weight: expected an NVFP4Tensor"),
    ],
)
def test_linear_validation(kwargs, exc, needle):
    args = dict(x=torch.randn(2, 32).bfloat16(), weight=_weight(16, 32))
    args.update(kwargs)
    x, weight = args.pop("x"), args.pop("weight")
    with pytest.raises(exc, match=needle):
        nvfp4_linear(x, weight, **args)


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        (dict(expert_offsets=torch.tensor([1, 2, 3])), TypeError, "expert_offsets: expected int32"),
        (dict(expert_offsets=torch.tensor([1, 2], dtype=torch.int32)), ValueError, r"expert_offsets: expected shape \(3,\)"),
        (dict(row_index=torch.tensor([0, 1])), TypeError, "row_index: expected int32"),
        (dict(activation="gelu"), ValueError, "activation"),
        (dict(swiglu_limit=1.0), ValueError, "swiglu_limit"),
        (dict(activation="swiglu", swiglu_limit=-1.0), ValueError, "swiglu_limit"),
        (dict(activation="swiglu", out=torch.empty(4, 16, dtype=torch.bfloat16)), ValueError, "out: expected shape"),
        (dict(weight=_weight(16, 32)), ValueError, r"\(E, N, K\)"),
    ],
)
def test_grouped_validation(kwargs, exc, needle):
    args = dict(
        x=torch.randn(4, 32).bfloat16(),
        weight=_weight(3, 16, 32),
        expert_offsets=torch.tensor([1, 2, 4], dtype=torch.int32),
    )
    args.update(kwargs)
    x, weight, offsets = args.pop("x"), args.pop("weight"), args.pop("expert_offsets")
    with pytest.raises(exc, match=needle):
        nvfp4_grouped_mm(x, weight, offsets, **args)


def test_ops_and_reference_share_signatures():
    import inspect

    for name in ("nvfp4_linear", "nvfp4_grouped_mm"):
        assert inspect.signature(getattr(ops_gemm, name)) == inspect.signature(getattr(ref_gemm, name))
