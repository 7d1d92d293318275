"""bf16 x bf16 -> float32 split-K GEMM (megamoe/kernels/gemm/bf16_splitk.py) and its op ``bf16_linear_fp32``.

The oracle is the exact product sum in float64; every element must lie within the documented bound
``error_bound_units(K, splits) * 2**-24 * sum_k |x_k| |w_nk|``. A kernel that drops a K chunk or a split, rounds the
result to bf16 or reads a wrong row misses it by orders of magnitude. On CPU the kernel runs through the interpreter
with tiny tiles (BLOCK_N 16, BLOCK_K 32), so N / K edges, uneven splits and row passes are crossed at test sizes; the
``cuda`` tests run the production config on V4 compressor shapes, graph replay == eager, no host syncs, same bits.
"""
import pytest
import torch

from gemm_helpers import sync_free_graph
from megamoe.kernels.gemm import bf16_splitk as bs
from megamoe.kernels.gemm.nvfp4_splitk import splitk_counters
from megamoe.ops import gemm as gemm_ops

U = 2.0 ** -24


def _launch(x, w, out=None, **kw):
    return bs.launch_bf16_splitk(x, w, out, interpreter=not x.is_cuda, **kw)


def _splits(m, n, k, device, splits):
    if splits is not None:
        block_k = (bs.INTERPRETER_CONFIG if device.type == "cpu" else bs.BF16_SPLITK_CONFIG)[2]
        steps = -(-k // block_k)
        per = -(-steps // max(1, min(splits, steps)))
        return -(-steps // per)
    return bs.plan_bf16_splitk(m, n, k, device, interpreter=device.type == "cpu")[0]


def _check_bound(y, x, w, splits, block_k, name=""):
    """Every element within the documented bound of the exact (float64) sum; returns the worst error in units."""
    exact = x.double().cpu() @ w.double().cpu().t()
    mag = x.double().abs().cpu() @ w.double().abs().cpu().t()
    units = bs.error_bound_units(x.shape[1], splits, block_k)
    err = (y.double().cpu() - exact).abs()
    bad = err > units * U * mag + 1e-300
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {y.numel()} elements beyond {units} u, worst "
                           f"{float((err / mag.clamp_min(1e-300)).max()) / U:.1f} u")
    return float((err / mag.clamp_min(1e-300)).max()) / U


@pytest.mark.parametrize("m,n,k,splits", [
    (1, 40, 96, None),   # planned splits (3 of one K step each), one row pass
    (3, 70, 200, 2),     # K % 32 != 0: ragged last step; N not a multiple of BLOCK_N
    (17, 33, 128, None), # two row passes of BLOCK_M 16
    (5, 1, 48, 1),       # one split: the direct store; N = 1
    (2, 48, 320, 10),    # one K step per split: 10 partials, the reduction tile padded to 16 splits
])
def test_within_bound_of_exact(device, m, n, k, splits):
    x = torch.randn(m, k).bfloat16().to(device)
    w = torch.randn(n, k).bfloat16().to(device)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=device)
    _launch(x, w, out, splits=splits)
    block_k = (bs.INTERPRETER_CONFIG if device.type == "cpu" else bs.BF16_SPLITK_CONFIG)[2]
    _check_bound(out, x, w, _splits(m, n, k, device, splits), block_k, f"{m}x{n}x{k}")
    assert not splitk_counters(device).any(), "every launch leaves the tile counters zero"


def test_wide_dynamic_range_and_cancellation(device):
    """Rows whose products cancel (x and -x halves) and magnitudes over 2**-60..2**60: the bound is relative to
    sum |x||w|, so cancellation must not cost more than the float32 sums allow."""
    m, n, k = 4, 24, 256
    x = torch.randn(m, k)
    x[:, k // 2:] = -x[:, :k // 2]
    x = (x * 2.0 ** torch.randint(-30, 30, (m, 1)).float()).bfloat16().to(device)
    w = (torch.randn(n, k) * 2.0 ** torch.randint(-30, 30, (n, 1)).float()).bfloat16().to(device)
    w[:, k // 2:] = w[:, :k // 2]
    y = _launch(x, w, splits=3)
    block_k = (bs.INTERPRETER_CONFIG if device.type == "cpu" else bs.BF16_SPLITK_CONFIG)[2]
    _check_bound(y, x, w, _splits(m, n, k, device, 3), block_k, "cancellation")


def test_zeros_nan_inf_and_empty(device):
    m, n, k = 3, 20, 96
    x = torch.randn(m, k).bfloat16().to(device)
    w = torch.randn(n, k).bfloat16().to(device)
    assert torch.equal(_launch(torch.zeros_like(x), w, splits=3), torch.zeros(m, n, device=device))
    x[1, 5] = float("nan")
    w[7, 9] = float("inf")
    y = _launch(x, w, splits=3).cpu()
    assert y[1].isnan().all(), "a NaN in x row 1 reaches every output of that row"
    assert not y[0, 7].isfinite() and not y[2, 7].isfinite(), "an Inf weight reaches its column"
    keep = torch.ones(n, dtype=torch.bool)
    keep[7] = False
    assert y[[0, 2]][:, keep].isfinite().all(), "NaN / Inf stay in their row / column"
    empty = _launch(x[:0], w)
    assert empty.shape == (0, n)
    assert _launch(x, w[:0]).shape == (m, 0)


def test_strided_out_and_x(device):
    m, n, k = 2, 36, 128
    xb = torch.randn(m, k + 32).bfloat16().to(device)
    x = xb[:, 16:16 + k]  # row stride k + 32
    w = torch.randn(n, k).bfloat16().to(device)
    big = torch.full((m, n + 8), float("nan"), dtype=torch.float32, device=device)
    _launch(x, w, big[:, :n], splits=2)
    block_k = (bs.INTERPRETER_CONFIG if device.type == "cpu" else bs.BF16_SPLITK_CONFIG)[2]
    _check_bound(big[:, :n], x, w, _splits(m, n, k, device, 2), block_k, "strided")
    assert big[:, n:].isnan().all(), "columns past N must not be written"


def test_op_routes_and_validation(device):
    """``bf16_linear_fp32``: float32 results within the bound on every route (the split-K kernel up to
    BF16_SPLITK_MAX_ROWS rows, the tile kernel above); clear errors for wrong arguments."""
    n, k = 24, 160
    w = torch.randn(n, k).bfloat16().to(device)
    for m in (1, gemm_ops.BF16_SPLITK_MAX_ROWS, gemm_ops.BF16_SPLITK_MAX_ROWS + 3):
        x = torch.randn(m, k).bfloat16().to(device)
        y = gemm_ops.bf16_linear_fp32(x, w)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        _check_bound(y, x, w, 32, 128, f"op m={m}")  # splits <= K steps: 32 covers every plan here
    x = torch.randn(2, k).bfloat16().to(device)
    with pytest.raises(TypeError, match="weight: expected bfloat16"):
        gemm_ops.bf16_linear_fp32(x, w.float())
    with pytest.raises(TypeError, match="x: expected bfloat16"):
        gemm_ops.bf16_linear_fp32(x.float(), w)
    with pytest.raises(ValueError, match="x: expected K=160"):
        gemm_ops.bf16_linear_fp32(x[:, :100], w)
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        gemm_ops.bf16_linear_fp32(x, w[None])
    with pytest.raises(TypeError, match="out: expected float32"):
        gemm_ops.bf16_linear_fp32(x, w, out=torch.empty(2, n, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="out: expected shape"):
        gemm_ops.bf16_linear_fp32(x, w, out=torch.empty(2, n + 1, device=device))


def test_cpu_reference_is_the_float32_linear(monkeypatch):
    """Without a GPU or the interpreter the op is ``x.float() @ w.float().T``: the bits of the float32 linear the
    layer ran before on float32 copies of the same weights."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' PyTorch references
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    assert torch.equal(gemm_ops.bf16_linear_fp32(x, w), x.float() @ w.float().t())


# ------------------------------------------------------------------------------------------------ CUDA
V4_COMP_SHAPES = [(2560, 4096), (1024, 4096), (2560, 7168), (1024, 7168)]  # CSA / HCA compressor, Flash / Pro


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", V4_COMP_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 8, 16, 17, 64, 65, 300])
def test_cuda_v4_shapes_within_bound(n, k, m):
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev).bfloat16()
    w = (torch.randn(n, k, device=dev) * k ** -0.5).bfloat16()
    y = gemm_ops.bf16_linear_fp32(x, w)
    splits = bs.plan_bf16_splitk(m, n, k, dev)[0] if m <= gemm_ops.BF16_SPLITK_MAX_ROWS else 1
    _check_bound(y, x, w, splits, 128, f"{m}x{n}x{k}")
    assert not splitk_counters(dev).any()


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
    assert not splitk_counters(dev).any()
