"""``megamoe.ops.gemm.bf16_linear_fp32``: float32 results of bf16 operands (the V4 compressor projections).

The oracle is the exact product sum in float64; every element must lie within
``bf16_linear_fp32_error_units(K) * 2**-24 * sum_k |x_k| |w_nk|``. Two input kinds: random signs (a wrong row, column
or dropped K chunk misses by orders of magnitude) and all-positive (no cancellation: |y| = sum |x||w|, so a result
rounded to bf16 anywhere misses the bound by ~40x). On CPU the op is the float32 linear itself (same bits).
"""
import pytest
import torch

from gemm_helpers import sync_free_graph
from megamoe.ops import gemm as gemm_ops

U = 2.0 ** -24


def _check_bound(y, x, w, name=""):
    exact = x.double().cpu() @ w.double().cpu().t()
    mag = x.double().abs().cpu() @ w.double().abs().cpu().t()
    units = gemm_ops.bf16_linear_fp32_error_units(x.shape[1])
    err = (y.double().cpu() - exact).abs()
    bad = err > units * U * mag
    worst = float((err / mag.clamp_min(1e-300)).max()) / U if y.numel() else 0.0
    assert not bad.any(), f"{name}: {int(bad.sum())} of {y.numel()} elements beyond {units} u (worst {worst:.1f} u)"
    return worst


def test_cpu_is_the_float32_linear():
    """On CPU (interpreter or not) the op is ``x.float() @ w.float().T``: the bits the layer computed before on float32
    copies of the same weights."""
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    assert torch.equal(gemm_ops.bf16_linear_fp32(x, w), x.float() @ w.float().t())
    out = torch.full((3, 16), float("nan"))
    assert gemm_ops.bf16_linear_fp32(x, w, out=out) is out and torch.equal(out, x.float() @ w.float().t())


def test_validation(device):
    n, k = 24, 160
    w = torch.randn(n, k).bfloat16().to(device)
    x = torch.randn(2, k).bfloat16().to(device)
    with pytest.raises(TypeError, match="weight: expected dtype torch.bfloat16"):
        gemm_ops.bf16_linear_fp32(x, w.float())
    with pytest.raises(TypeError, match="weight: expected a torch.Tensor"):
        gemm_ops.bf16_linear_fp32(x, w.tolist())
    with pytest.raises(TypeError, match="x: expected bfloat16"):
        gemm_ops.bf16_linear_fp32(x.float(), w)
    with pytest.raises(ValueError, match="x: expected K=160"):
        gemm_ops.bf16_linear_fp32(x[:, :100], w)
    with pytest.raises(ValueError, match="weight: expected 2 dimensions"):
        gemm_ops.bf16_linear_fp32(x, w[None])
    with pytest.raises(TypeError, match="out: expected dtype torch.float32"):
        gemm_ops.bf16_linear_fp32(x, w, out=torch.empty(2, n, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="out: expected shape"):
        gemm_ops.bf16_linear_fp32(x, w, out=torch.empty(2, n + 1, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        gemm_ops.bf16_linear_fp32(x, w, out=torch.empty(n, 2, device=device).t())
    assert gemm_ops.bf16_linear_fp32(x[:0], w).shape == (0, n)


def test_bound_is_not_vacuous():
    """The test bound rejects the failures it is meant to catch: a result rounded to bf16 on all-positive inputs, and
    one dropped 128-element K chunk on random ones (both computed here on the CPU)."""
    k = 4096
    x = torch.rand(8, k).bfloat16()
    w = torch.rand(64, k).bfloat16()
    y = x.float() @ w.float().t()
    _check_bound(y, x, w, "float32")
    with pytest.raises(AssertionError, match="beyond"):
        _check_bound(y.bfloat16().float(), x, w, "rounded to bf16")
    xs, ws = torch.randn(8, k).bfloat16(), torch.randn(64, k).bfloat16()
    dropped = xs[:, 128:].float() @ ws[:, 128:].float().t()
    with pytest.raises(AssertionError, match="beyond"):
        _check_bound(dropped, xs, ws, "one chunk dropped")


# ------------------------------------------------------------------------------------------------ CUDA
V4_COMP_SHAPES = [(2560, 4096), (1024, 4096), (2560, 7168), (1024, 7168)]  # CSA / HCA compressor, Flash / Pro


@pytest.mark.cuda
@pytest.mark.parametrize("route", ["cublas", "tile"])
@pytest.mark.parametrize("n,k", V4_COMP_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 8, 16, 17, 64, 65, 300, 4096])
def test_cuda_v4_shapes_within_bound(monkeypatch, route, n, k, m):
    """Both CUDA routes (cuBLAS; the tile kernel where torch lacks ``out_dtype``) on random-sign and all-positive
    inputs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if route == "tile":
        monkeypatch.setattr(gemm_ops, "MM_OUT_DTYPE", False)
    for kind in ("signed", "positive"):
        if kind == "signed":
            x = torch.randn(m, k, device=dev).bfloat16()
            w = (torch.randn(n, k, device=dev) * k ** -0.5).bfloat16()
        else:
            x = torch.rand(m, k, device=dev).bfloat16()
            w = (torch.rand(n, k, device=dev) * k ** -0.5).bfloat16()
        _check_bound(gemm_ops.bf16_linear_fp32(x, w), x, w, f"{route} {kind} {m}x{n}x{k}")


@pytest.mark.cuda
def test_cuda_zeros_nan_inf():
    dev = torch.device("cuda")
    n, k = 1024, 4096
    x = torch.randn(4, k, device=dev).bfloat16()
    w = torch.randn(n, k, device=dev).bfloat16()
    assert torch.equal(gemm_ops.bf16_linear_fp32(torch.zeros_like(x), w), torch.zeros(4, n, device=dev))
    x[1, 5] = float("nan")
    w[7, 9] = float("inf")
    y = gemm_ops.bf16_linear_fp32(x, w).cpu()
    assert y[1].isnan().all(), "a NaN in x row 1 reaches every output of that row"
    assert not y[0, 7].isfinite() and not y[2, 7].isfinite(), "an Inf weight reaches its column"
    keep = torch.ones(n, dtype=torch.bool)
    keep[7] = False
    assert y[[0, 2, 3]][:, keep].isfinite().all(), "NaN / Inf stay in their row / column"


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 64, 200])
def test_cuda_graph_equals_eager_sync_free_same_bits(m):
    dev = torch.device("cuda")
    n, k = 2560, 4096
    x = torch.randn(m, k, device=dev).bfloat16()
    w = torch.randn(n, k, device=dev).bfloat16()
    out = torch.empty(m, n, device=dev)
    eager = gemm_ops.bf16_linear_fp32(x, w).clone()
    assert torch.equal(gemm_ops.bf16_linear_fp32(x, w), eager), "the same bits on every run"
    graph, _ = sync_free_graph(lambda: gemm_ops.bf16_linear_fp32(x, w, out=out))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay == eager"
    x.copy_(torch.randn(m, k, device=dev).bfloat16())  # new inputs in place: the replay follows them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemm_ops.bf16_linear_fp32(x, w))
