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
    assert (torch.equal(back.data, w.data)
            and torch.equal(back.block_scale.view(torch.uint8), w.block_scale.view(torch.uint8)))


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
        (dict(activation="gelu"), ValueError, "activation"),
        (dict(swiglu_limit=1.0), ValueError, "swiglu_limit"),
        (dict(activation="swiglu", swiglu_limit=float("inf")), ValueError, "swiglu_limit"),
        (dict(activation="swiglu", out=torch.empty(2, 16, dtype=torch.bfloat16)), ValueError,
         r"out: expected shape \(2, 8\)"),
        (dict(activation="swiglu", bias=torch.randn(16)), ValueError, "bias: not supported"),
        (dict(activation="swiglu", weight=_weight(15, 32)), ValueError, "even N"),
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
        (dict(expert_offsets=torch.tensor([1, 2], dtype=torch.int32)), ValueError,
         r"expert_offsets: expected shape \(3,\)"),
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


def test_decode_route_on_cpu_is_the_triton_gemm():
    x = torch.randn(8, 256).bfloat16()
    w = _weight(4, 32, 256)
    assert ops_gemm.decode_route(x, w.data, 8, 4, 32, 256) == "tensor-core"


@pytest.mark.cuda
def test_cuda_ops_take_every_route(monkeypatch):
    """Grouped up to 256 rows per expert -> Gluon mma / wgmma launches by row band, K % 128 != 0 ->
    CUDA-core kernel, dense M=1 -> split-K, more than 256 rows per expert -> the pipelined wgmma kernel (PIPE_ROUTE,
    default on), with it off the warp-specialized kernel (WS_ROUTE), with both off the Triton tensor-core GEMM;
    each route matches float32 math on the decoded weights."""
    from gemm_helpers import grouped_f32, rel_err  # tests/gemm_helpers.py (tests/ is on sys.path)

    device = torch.device("cuda")
    e = 64
    cases = [(40, 256, 512, "banded"), (40, 256, 480, "gemv"), (64 * 64, 256, 512, "banded"),
             (64 * 300, 256, 512, "pipe"), (64 * 300, 256, 512, "ws"), (64 * 300, 256, 512, "tensor-core")]
    for t, n, k, route in cases:
        monkeypatch.setattr(ops_gemm, "WS_ROUTE", route == "ws")
        monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", route in ("pipe", "banded"))
        w = quantize(torch.randn(e, n, k) * 0.05).to(device)
        counts = torch.bincount(torch.randint(0, e, (t - 3,)), minlength=e)
        offsets = counts.cumsum(0).to(torch.int32).to(device)
        x = torch.randn(t, k, device=device).bfloat16()
        row_index = torch.randperm(t, device=device).to(torch.int32)
        assert ops_gemm.decode_route(x, w.data, t, e, n, k) == route
        out = nvfp4_grouped_mm(x, w, offsets, row_index=row_index)
        ref = grouped_f32(x, w, offsets, row_index)
        assert rel_err(out[: t - 3], ref[: t - 3]) < 1e-2 and (out[t - 3:] == 0).all(), route
        sw = nvfp4_grouped_mm(x, interleave_gate_up(w), offsets, activation="swiglu", swiglu_limit=7.0)
        y = grouped_f32(x, w, offsets)
        inter = torch.stack((y[:, : n // 2], y[:, n // 2:]), dim=-1).reshape(t, n)
        assert rel_err(sw[: t - 3], ref_gemm.swiglu_reference(inter, 7.0)[: t - 3]) < 1e-2, route
    dense = quantize(torch.randn(256, 512) * 0.05, per_row=True).to(device)
    xd = torch.randn(1, 512, device=device).bfloat16()
    assert ops_gemm.decode_route(xd, dense.data, 1, None, 256, 512) == "splitk"
    bias = torch.randn(256, device=device).bfloat16()
    ref_d = xd.float().cpu() @ dequantize(dense.to("cpu"), torch.float32).t() + bias.float().cpu()
    assert rel_err(nvfp4_linear(xd, dense, bias), ref_d) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 8, 64, 256])
def test_cuda_dense_linear_routes(m):
    """Dense decode sizes take the split-K kernel (M <= 64, also for K % 128 != 0; up to 256 where K >= 4096:
    ``nvfp4_splitk.splitk_max_rows``), larger M the previous routes; every route matches float32 math on the
    decoded weights, with bias and w4a4."""
    from megamoe.kernels.gemm.nvfp4_splitk import splitk_max_rows
    from gemm_helpers import rel_err  # tests/gemm_helpers.py (tests/ is on sys.path)

    device = torch.device("cuda")
    for n, k in [(1024, 4096), (1000, 1040)]:
        w = quantize(torch.randn(n, k) * 0.05, per_row=True).to(device)
        x = torch.randn(m, k, device=device).bfloat16()
        bias = torch.randn(n, device=device)
        route = ops_gemm.decode_route(x, w.data, m, None, n, k)
        assert (route == "splitk") == (m <= splitk_max_rows(n, k)), route
        assert splitk_max_rows(n, k) >= 64
        ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t() + bias.cpu()
        assert rel_err(nvfp4_linear(x, w, bias), ref) < 1e-2, route
        xa = ref_gemm.activations_for_mode(x.cpu(), "w4a4").float()
        ref4 = xa @ dequantize(w.to("cpu"), torch.float32).t()
        assert rel_err(nvfp4_linear(x, w, mode="w4a4"), ref4) < 1e-2, route


def _stride2(t):
    """Same values, stride 2 (non-contiguous)."""
    buf = torch.zeros(2 * t.shape[0], dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_grouped_non_contiguous_index_tensors_equal_contiguous(activation):
    w = _weight(3, 16, 32)
    x = torch.randn(5, 32).bfloat16()
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)
    row_index = torch.tensor([4, 0, 3, 3, 1, 2], dtype=torch.int32)
    kw = dict(activation=activation, swiglu_limit=7.0 if activation else None)
    want = nvfp4_grouped_mm(x, w, offsets, **kw)
    assert not _stride2(offsets).is_contiguous()
    assert torch.equal(nvfp4_grouped_mm(x, w, _stride2(offsets), **kw), want)
    want = nvfp4_grouped_mm(x, w, offsets, row_index=row_index, **kw)
    got = nvfp4_grouped_mm(x, w, _stride2(offsets), row_index=_stride2(row_index), **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("limit", [True, float("inf"), float("nan"), "7", 0, -2.0])
def test_grouped_swiglu_limit_must_be_finite_positive(limit):
    with pytest.raises((ValueError, TypeError), match="swiglu_limit"):
        nvfp4_grouped_mm(torch.randn(4, 32).bfloat16(), _weight(3, 16, 32), torch.tensor([1, 2, 4], dtype=torch.int32),
                         activation="swiglu", swiglu_limit=limit)


def test_grouped_mm_row_interleaved_weights_same_result_and_refusals():
    """Row-interleaved expert weights (NVFP4Tensor.row_interleave 4) give the row-major result on every device
    (CPU / interpreter: a row-major copy; CUDA: the Gluon routes read them, the same bits); other ops and modes
    refuse them with a ValueError."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    counts = [0, 3, 17, 40, 1, 90] if cuda else [0, 3, 1, 5]  # the interpreter is slow: small on CPU
    e, n, k = len(counts), 256 if cuda else 64, 512 if cuda else 256
    w = quantize(torch.randn(e, n, k, device=device))
    w4 = w.interleave_rows(4)
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    row_index = torch.randperm(t, device=device).to(torch.int32)
    for kwargs in (dict(), dict(row_index=row_index, activation="swiglu", swiglu_limit=7.0)):
        for hint in (None, max(counts)) if cuda else (None,):
            plain = nvfp4_grouped_mm(x, w, offsets, max_rows_per_expert=hint, **kwargs)
            inter = nvfp4_grouped_mm(x, w4, offsets, max_rows_per_expert=hint, **kwargs)
            assert torch.equal(inter, plain)
    if cuda:  # decode sizes: the BLOCK_M 8 band (64 weight rows per program when gathered and interleaved)
        small = torch.tensor([1, 2, 0, 1, 3, 1], device=device).cumsum(0).to(torch.int32)
        gather = torch.randint(0, 4, (int(small[-1]) + 1,), device=device, dtype=torch.int32)
        for kwargs in (dict(), dict(row_index=gather, activation="swiglu", swiglu_limit=7.0)):
            xs = x[:gather.shape[0]]
            plain = nvfp4_grouped_mm(xs, w, small, max_rows_per_expert=3, **kwargs)
            inter = nvfp4_grouped_mm(xs, w4, small, max_rows_per_expert=3, **kwargs)
            assert torch.equal(inter, plain)
    with pytest.raises(ValueError, match="w4a16"):
        nvfp4_grouped_mm(x, w4, offsets, mode="w4a4")
    with pytest.raises(ValueError, match="row_interleave"):
        nvfp4_linear(x, NVFP4Tensor(w4.data[0], w4.block_scale[0], w4.global_scale, (n, k), 4))


@pytest.mark.parametrize("per_row", [False, True])
def test_dense_as_one_expert_equals_linear_reference(monkeypatch, per_row):
    """The "dense-pipe" wrapping (one expert holding every row; a 0-d or (N, 1) global scale as (1, N, 1)) computes
    the dense product: on the ops' PyTorch references it equals ``nvfp4_linear`` bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = quantize(torch.randn(48, 64) * 0.05, per_row=per_row)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(ops_gemm._dense_as_one_expert(x, w, None), nvfp4_linear(x, w))
    out = torch.empty(5, 48, dtype=torch.bfloat16)
    assert ops_gemm._dense_as_one_expert(x, w, out) is out and torch.equal(out, nvfp4_linear(x, w))


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_linear_swiglu_is_the_grouped_swiglu_of_one_expert(monkeypatch, interpret):
    """nvfp4_linear(activation="swiglu"): the reference and (interpreter) the one-expert grouped route give the
    SwiGLU of the float32 product, bit for bit the grouped GEMM's with one expert holding every row."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    w = interleave_gate_up(quantize(torch.randn(48, 64) * 0.05, per_row=True))
    x = torch.randn(5, 64).bfloat16()
    got = nvfp4_linear(x, w, activation="swiglu", swiglu_limit=0.05)
    assert got.shape == (5, 24)
    w3 = NVFP4Tensor(w.data[None], w.block_scale[None], w.global_scale[None], (1, 48, 64))
    expect = nvfp4_grouped_mm(x, w3, torch.tensor([5], dtype=torch.int32), activation="swiglu", swiglu_limit=0.05)
    assert torch.equal(got, expect)
    f32 = ref_gemm.swiglu_reference(x.float() @ dequantize(w, torch.float32).t(), 0.05)
    assert ((got.float() - f32).norm() / f32.norm()).item() < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("m", [512, 600, 4096])
def test_cuda_dense_prefill_takes_the_pipelined_kernel(m):
    """From DENSE_PIPE_MIN_ROWS rows a dense w4a16 GEMM without bias runs as one expert on the pipelined kernel: the
    grouped op's bits, float32 math on the decoded weights, graph replay == eager without host syncs; with a bias it
    keeps the Triton tensor-core kernel."""
    from gemm_helpers import rel_err, sync_free_graph  # tests/gemm_helpers.py (tests/ is on sys.path)

    device = torch.device("cuda")
    for n, k in [(1536, 4096), (4096, 8192)]:
        w = quantize(torch.randn(n, k) * 0.05, per_row=True).to(device)
        x = torch.randn(m, k, device=device).bfloat16()
        assert ops_gemm.decode_route(x, w.data, m, None, n, k) == "dense-pipe"
        y = nvfp4_linear(x, w)
        ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t()
        assert rel_err(y, ref) < 1e-2
        offsets = torch.full((1,), m, dtype=torch.int32, device=device)
        w3 = NVFP4Tensor(w.data[None], w.block_scale[None], w.global_scale.reshape(1, -1, 1), (1, n, k))
        assert torch.equal(y, nvfp4_grouped_mm(x, w3, offsets, max_rows_per_expert=m))
        bias = torch.randn(n, device=device)
        assert rel_err(nvfp4_linear(x, w, bias), ref + bias.cpu()) < 1e-2
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        graph, _ = sync_free_graph(lambda: nvfp4_linear(x, w, out=out))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
