"""Route "dense-bf16" of ``nvfp4_linear``: prefill-sized dense GEMMs as bf16 cuBLAS on the exactly dequantized weight,
with the global scale read once to the host (``host_global_scale``) and applied as cuBLAS's alpha."""
import math

import pytest
import torch

from megamoe.format.tensor import NVFP4Tensor
from megamoe.layers.linear import DenseLinear, concat_rows
from megamoe.ops import gemm as ops_gemm
from megamoe.ops.gemm import HostGlobalScale, host_global_scale, nvfp4_linear
from megamoe.reference.quantize import dequantize, quantize


def _weight(n, k, scale=None):
    w = quantize(torch.randn(n, k) * 0.05)
    if scale is not None:
        w = NVFP4Tensor(w.data, w.block_scale, torch.tensor(scale, dtype=torch.float32), (n, k))
    return w


def _fused(sizes, k, scales):
    """Row-concatenated parts with distinct global scales: a (N, 1) global scale of one run per part."""
    return concat_rows([_weight(n, k, s) for n, s in zip(sizes, scales)])


def _bound_check(y, x, w):
    """Element-wise: |y - x @ W| <= (K / 8 + 320) 2**-24 sum_k |x_k| |w_nk| + 2**-8 |x @ W| (float32 sums in any order,
    one bf16 rounding; float64 oracle on the decoded weight). Dropping one 16-element K block, a wrong row's scale or a
    wrong row range exceeds it by orders of magnitude."""
    xd, wd = x.double().cpu(), dequantize(w.to("cpu"), torch.float32).double()
    exact = xd @ wd.t()
    slack = (xd.abs() @ wd.abs().t()) * ((x.shape[1] / 8 + 320) * 2.0**-24) + exact.abs() * 2.0**-8
    err = (y.double().cpu() - exact).abs()
    assert bool((err <= slack).all()), f"worst excess {(err - slack).max().item():.3e}"


def test_host_global_scale_runs():
    w = _weight(32, 64, 0.25)
    hs = host_global_scale(w)
    assert isinstance(hs, HostGlobalScale) and hs.segments == ((0, 32, 0.25),)
    f = _fused((16, 48, 32), 64, (0.5, 0.75, 0.5))
    assert f.global_scale.shape == (96, 1)
    assert host_global_scale(f).segments == ((0, 16, 0.5), (16, 64, 0.75), (64, 96, 0.5))
    per_row = quantize(torch.randn(40, 64), per_row=True)  # a distinct scale per row: more runs than the limit
    assert host_global_scale(per_row) is None
    many = host_global_scale(per_row, device_scale_ok=True)  # the SwiGLU variant applies the scale on the device
    assert many.segments is None and many.source == ops_gemm._scale_source(per_row.global_scale)
    assert host_global_scale(_weight(16, 32, math.nan), device_scale_ok=True) is None
    for bad in (0.0, -1.0, math.inf, math.nan):
        assert host_global_scale(_weight(16, 32, bad)) is None, bad


def test_host_global_scale_validation():
    with pytest.raises(TypeError, match="weight: expected an NVFP4Tensor"):
        host_global_scale(torch.zeros(4, 4))
    w3 = quantize(torch.randn(2, 16, 32))
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        host_global_scale(w3)


def test_linear_refuses_a_foreign_or_stale_host_scale():
    w, other = _weight(16, 32, 0.5), _weight(16, 32, 0.5)
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(TypeError, match="host_scale: expected a HostGlobalScale"):
        nvfp4_linear(x, w, host_scale=0.5)
    with pytest.raises(ValueError, match="host_scale: it was not read from this weight"):
        nvfp4_linear(x, w, host_scale=host_global_scale(other))
    hs = host_global_scale(w)
    assert torch.equal(nvfp4_linear(x, w, host_scale=hs), nvfp4_linear(x, w))  # CPU: the reference, same bits
    w.global_scale.mul_(2.0)  # changed in place: the host copy is stale
    with pytest.raises(ValueError, match="changed in place"):
        nvfp4_linear(x, w, host_scale=hs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dequantize kernel on CPU tensors")
@pytest.mark.parametrize("sizes,scales", [((48,), (0.3,)), ((16, 48, 32), (0.5, 1.75, 0.0625))])
def test_dense_bf16_route_math_on_cpu(sizes, scales):
    """The route's own steps (the dequantize kernel under the interpreter, then ``torch.addmm`` with alpha per run of
    the scale) on CPU tensors: within the float32 / one-rounding bound of the decoded product. A run's alpha applied
    to the wrong columns would be off by the parts' scale ratios (1.5-28x)."""
    w = _fused(sizes, 64, scales) if len(sizes) > 1 else _weight(sizes[0], 64, scales[0])
    x = torch.randn(7, 64).bfloat16()
    out = torch.full((7, sum(sizes)), float("nan"), dtype=torch.bfloat16)
    y = ops_gemm._dense_bf16(x, w, host_global_scale(w), out)
    assert y is out
    _bound_check(y, x, w)


@pytest.mark.cuda
@pytest.mark.parametrize("extra", [0, 1, 344])
def test_cuda_dense_bf16_route(monkeypatch, extra):
    """From DENSE_BF16_MIN_ROWS rows (N <= DENSE_BF16_NARROW_N), given the host scale, the route runs: its output is
    within the float32 bound for a 0-d and a three-part (N, 1) scale, written into ``out`` (also a row-strided view:
    there cuBLAS with reduced-precision split-K reductions gave bf16 partials, over the bound), a NaN block scale stays
    in its column, a NaN in x stays in its row, zero x gives zeros, M = 0 gives an empty result; graph replay == eager
    without host syncs; one row fewer keeps the kernels' route."""
    from gemm_helpers import sync_free_graph  # tests/gemm_helpers.py (tests/ is on sys.path)

    device = torch.device("cuda")
    assert ops_gemm.DENSE_BF16_NARROW_N >= 2304  # both weights below are narrow
    m = ops_gemm.DENSE_BF16_MIN_ROWS + extra
    calls = []
    route = ops_gemm._dense_bf16
    monkeypatch.setattr(ops_gemm, "_dense_bf16", lambda *a: calls.append(a[0].shape[0]) or route(*a))
    k = 1024
    for w in (_weight(1536, k, 0.002).to(device), _fused((512, 1536, 256), k, (0.002, 0.0035, 0.00075)).to(device)):
        n = w.shape[0]
        hs = host_global_scale(w)
        x = torch.randn(m, k, device=device).bfloat16()
        y = nvfp4_linear(x, w, host_scale=hs)
        _bound_check(y, x, w)
        assert calls == [m]
        big = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device=device)
        view = big[:, 4:4 + n]
        assert nvfp4_linear(x, w, out=view, host_scale=hs) is view
        _bound_check(view, x, w)  # not y's bits: cuBLAS picks its algorithm by the output's row stride too
        assert big[:, :4].isnan().all() and big[:, 4 + n:].isnan().all()
        assert (nvfp4_linear(torch.zeros_like(x), w, host_scale=hs) == 0).all()
        xn = x.clone()
        xn[3, 100] = float("nan")
        yn = nvfp4_linear(xn, w, host_scale=hs)
        assert yn[3].isnan().all() and not yn[torch.arange(m, device=device) != 3].isnan().any()
        _bound_check(yn[4:], x[4:], w)
        assert nvfp4_linear(x[:0], w, host_scale=hs).shape == (0, n)  # M = 0: no launch
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        graph, _ = sync_free_graph(lambda: nvfp4_linear(x, w, out=out, host_scale=hs))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
        fewer = x[: ops_gemm.DENSE_BF16_MIN_ROWS - 1]
        calls.clear()
        _bound_check(nvfp4_linear(fewer, w, host_scale=hs), fewer, w)
        assert calls == []
    w = _weight(512, k, 0.002)
    scale = w.block_scale.view(torch.uint8).clone()
    scale[37, 5] = 0x7F  # E4M3 NaN in row 37
    w = NVFP4Tensor(w.data, scale.view(torch.float8_e4m3fn), w.global_scale, w.shape).to(device)
    x = torch.randn(m, k, device=device).bfloat16()
    y = nvfp4_linear(x, w, host_scale=host_global_scale(w))
    assert y[:, 37].isnan().all() and not y[:, :37].isnan().any() and not y[:, 38:].isnan().any()


@pytest.mark.cuda
@pytest.mark.parametrize("extra", [0, 88])
def test_cuda_dense_bf16_swiglu(monkeypatch, extra):
    """activation="swiglu" on the route: cuBLAS's float32 product, then the scaled SwiGLU (the global scale read on
    the device): within the float32 reference's bound and the grouped one-expert path's, a NaN in x stays in its row,
    graph replay == eager without host syncs; one row fewer keeps split-K / grouped; a gate/up weight of separately
    scaled parts (its interleaved scale alternates: too many runs for the plain route) takes the SwiGLU variant with
    ``device_scale_ok``, and the plain route refuses that copy (the kernels run)."""
    from gemm_helpers import rel_err, sync_free_graph

    from megamoe.ops.gemm import interleave_gate_up
    from megamoe.reference.gemm import swiglu_reference

    device = torch.device("cuda")
    m, k = ops_gemm.DENSE_BF16_MIN_ROWS + extra, 1024
    calls = []
    route = ops_gemm._dense_bf16
    monkeypatch.setattr(ops_gemm, "_dense_bf16", lambda *a: calls.append(a[0].shape[0]) or route(*a))
    w = interleave_gate_up(_weight(1536, k, 0.002)).to(device)
    hs = host_global_scale(w)
    x = torch.randn(m, k, device=device).bfloat16()
    f32 = x.double().cpu() @ dequantize(w.to("cpu"), torch.float32).double().t()
    limit = float(f32.abs().median())
    ref = swiglu_reference(f32.float(), limit)
    y = nvfp4_linear(x, w, activation="swiglu", swiglu_limit=limit, host_scale=hs)
    assert calls == [m] and y.shape == (m, 768)
    assert rel_err(y, ref) < 4e-3
    grouped = nvfp4_linear(x, w, activation="swiglu", swiglu_limit=limit)
    assert rel_err(y, grouped.float()) < 4e-3
    assert rel_err(swiglu_reference(f32.float(), None), ref) > 0.1  # the clamp bites at this limit
    xn = x.clone()
    xn[5, 7] = float("nan")
    yn = nvfp4_linear(xn, w, activation="swiglu", swiglu_limit=limit, host_scale=hs)
    assert yn[5].isnan().all() and not yn[torch.arange(m, device=device) != 5].isnan().any()
    out = torch.empty(m, 768, dtype=torch.bfloat16, device=device)
    graph, _ = sync_free_graph(lambda: nvfp4_linear(x, w, out=out, activation="swiglu", swiglu_limit=limit,
                                                    host_scale=hs))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
    calls.clear()
    fewer = x[: ops_gemm.DENSE_BF16_MIN_ROWS - 1]
    assert rel_err(nvfp4_linear(fewer, w, activation="swiglu", swiglu_limit=limit, host_scale=hs),
                   ref[: len(fewer)]) < 4e-3
    assert calls == []
    per_row = interleave_gate_up(_fused((768, 768), k, (0.002, 0.0035))).to(device)
    assert host_global_scale(per_row) is None  # alternating rows: more runs than HOST_SCALE_MAX_SEGMENTS
    hs_rows = host_global_scale(per_row, device_scale_ok=True)
    got = nvfp4_linear(x, per_row, activation="swiglu", swiglu_limit=limit, host_scale=hs_rows)
    assert calls == [m]
    f32 = x.double().cpu() @ dequantize(per_row.to("cpu"), torch.float32).double().t()
    assert rel_err(got, swiglu_reference(f32.float(), limit)) < 4e-3
    calls.clear()
    _bound_check(nvfp4_linear(x, per_row, host_scale=hs_rows), x, per_row)  # no segments: the kernels' route
    assert calls == []


@pytest.mark.cuda
def test_cuda_dense_bf16_wide_weights_need_more_rows(monkeypatch):
    """N > DENSE_BF16_NARROW_N: the kernels' route up to DENSE_BF16_WIDE_MIN_ROWS - 1 rows, the route from there."""
    device = torch.device("cuda")
    calls = []
    route = ops_gemm._dense_bf16
    monkeypatch.setattr(ops_gemm, "_dense_bf16", lambda *a: calls.append(a[0].shape[0]) or route(*a))
    k, wide = 512, ops_gemm.DENSE_BF16_NARROW_N + 256
    w = _fused((wide - 1024, 1024), k, (0.001, 0.0025)).to(device)
    hs = host_global_scale(w)
    for m in (ops_gemm.DENSE_BF16_MIN_ROWS, ops_gemm.DENSE_BF16_WIDE_MIN_ROWS - 1, ops_gemm.DENSE_BF16_WIDE_MIN_ROWS):
        x = torch.randn(m, k, device=device).bfloat16()
        _bound_check(nvfp4_linear(x, w, host_scale=hs), x, w)
    assert calls == [ops_gemm.DENSE_BF16_WIDE_MIN_ROWS]


@pytest.mark.cuda
def test_cuda_dense_bf16_decode_is_exact():
    """Identity activations (K rows) through the route: every E2M1 code under odd E4M3 block scales comes back as the
    weight, times the global scale, rounded once (global scale 1: bit for bit the decoded weight)."""
    from gemm_helpers import every_code_weight  # tests/gemm_helpers.py (tests/ is on sys.path)

    device = torch.device("cuda")
    n, k = 320, 1024  # K rows of identity: at least DENSE_BF16_MIN_ROWS
    assert k >= ops_gemm.DENSE_BF16_MIN_ROWS
    w3 = every_code_weight(n, k, "cpu")
    for gs in (1.0, 0.7):
        w = NVFP4Tensor(w3.data[0], w3.block_scale[0], torch.tensor(gs), (n, k)).to(device)
        y = nvfp4_linear(torch.eye(k).bfloat16().to(device), w, host_scale=host_global_scale(w))
        ref = dequantize(NVFP4Tensor(w3.data[0], w3.block_scale[0], torch.tensor(1.0), (n, k)), torch.float32)
        assert torch.equal(y.cpu(), (ref.t() * gs).bfloat16()), gs


@pytest.mark.cuda
def test_cuda_dense_linear_passes_its_host_scale():
    """``DenseLinear`` reads the host scale at construction and its prefill calls take the route (the op's bits)."""
    device = torch.device("cuda")
    w = _fused((256, 768), 512, (0.001, 0.003)).to(device)
    layer = DenseLinear(w, name="x_proj")
    assert layer.host_scale == host_global_scale(w)
    x = torch.randn(512, 512, device=device).bfloat16()
    assert torch.equal(layer(x), nvfp4_linear(x, w, host_scale=layer.host_scale))
