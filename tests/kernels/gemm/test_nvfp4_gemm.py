"""NVFP4 GEMM kernels (megamoe/kernels/gemm/nvfp4_gemm.py) against float32 math on the decoded weights.

On CPU these run through the Triton interpreter at small shapes with the
interpreter's tiny tile config (BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, 3 persistent
programs), so shapes below are chosen to cross tile edges. The ``cuda`` tests
run the real kernels on the GPU, with the production configs, plus the
no-host-sync and CUDA-graph checks.
"""
import pytest
import torch

from gemm_helpers import grouped_f32, offsets_of, random_weight, rel_err
from megamoe.format.tensor import NVFP4Tensor
from megamoe.ops._dispatch import use_triton
from megamoe.ops.gemm import interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear
from megamoe.reference.gemm import swiglu_reference
from megamoe.reference.quantize import dequantize, quantize
from sync_helpers import no_host_syncs


def test_kernel_path_is_used(device):
    assert use_triton(torch.empty(1, device=device)), "tests must exercise the Triton kernels"


@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (5, 64, 64), (37, 40, 160)])
@pytest.mark.parametrize("scale_kind", ["tensor", "row"])
def test_linear_matches_float32(device, m, n, k, scale_kind):
    w = random_weight((n, k), device, per_row_scale=scale_kind == "row")
    x = torch.randn(m, k).bfloat16().to(device)
    out = nvfp4_linear(x, w)
    ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), ref) < 1e-2
    # tighter: only fp32 summation order and the final bf16 rounding differ
    assert rel_err(out.cpu(), ref) < 4e-3


def test_linear_bias_and_out_buffer(device):
    n, k = 48, 96
    w = random_weight((n, k), device)
    x = torch.randn(7, k).bfloat16().to(device)
    bias = torch.randn(n).bfloat16().to(device)
    out = torch.full((7, n), float("nan"), dtype=torch.bfloat16, device=device)
    got = nvfp4_linear(x, w, bias, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t() + bias.float().cpu()
    assert rel_err(out.cpu(), ref) < 4e-3


def test_linear_empty_and_zero(device):
    w = random_weight((32, 64), device)
    assert nvfp4_linear(torch.empty(0, 64, dtype=torch.bfloat16, device=device), w).shape == (0, 32)
    zero = NVFP4Tensor(torch.zeros_like(w.data), torch.zeros_like(w.block_scale), w.global_scale, w.shape)
    out = nvfp4_linear(torch.randn(3, 64).bfloat16().to(device), zero)
    assert torch.equal(out.cpu(), torch.zeros(3, 32, dtype=torch.bfloat16))


def test_linear_w4a4_matches_reference_quantized_activations(device):
    n, k = 40, 96
    w = random_weight((n, k), device)
    x = (torch.randn(6, k) * torch.logspace(-2, 2, 6)[:, None]).bfloat16().to(device)
    out = nvfp4_linear(x, w, mode="w4a4")
    xq = dequantize(quantize(x.cpu(), per_row=True), torch.float32)
    ref = xq @ dequantize(w.to("cpu"), torch.float32).t()
    assert rel_err(out.cpu(), ref) < 4e-3
    # and the activation quantization really happened: w4a16 differs measurably
    exact = x.cpu().float() @ dequantize(w.to("cpu"), torch.float32).t()
    assert rel_err(out.cpu(), exact) > 1e-2


def test_linear_nan_block_policy(device):
    n, k = 32, 64
    src = torch.randn(n, k) * 0.05
    src[5, 16:32] = float("nan")  # one block of row 5
    w = quantize(src).to(device)
    out = nvfp4_linear(torch.randn(2, k).bfloat16().to(device), w).cpu()
    assert torch.isnan(out[:, 5]).all()
    assert torch.isfinite(out[:, torch.arange(n) != 5]).all()


@pytest.mark.parametrize(
    "counts",
    [
        [3, 0, 17, 1, 16],  # empty expert, rows not a multiple of the tile, exactly one tile
        [0, 0, 40, 0, 0],  # one expert owns everything (three m-tiles)
        [0, 0, 0, 0, 0],  # every row is padding
        [1, 1, 1, 1, 1],  # decode-like
    ],
)
def test_grouped_matches_float32(device, counts):
    e, n, k = len(counts), 48, 96
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    pad = 3
    t = sum(counts) + pad
    x = torch.randn(t, k).bfloat16().to(device)
    offsets = offsets_of(counts, device)
    out = nvfp4_grouped_mm(x, w, offsets)
    ref = grouped_f32(x, w, offsets)
    assert out.shape == (t, n)
    real = sum(counts)
    assert torch.equal(out[real:].cpu(), torch.zeros(pad, n, dtype=torch.bfloat16)), "padding rows must be 0"
    if real:
        assert rel_err(out[:real].cpu(), ref[:real]) < 4e-3


def test_grouped_zero_rows(device):
    w = random_weight((4, 32, 64), device)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    offsets = torch.zeros(4, dtype=torch.int32, device=device)
    assert nvfp4_grouped_mm(x, w, offsets).shape == (0, 32)
    assert nvfp4_grouped_mm(x, interleave_gate_up(w), offsets, activation="swiglu").shape == (0, 16)


def test_grouped_per_row_scales_and_row_index(device):
    e, n, k, s = 3, 64, 128, 9
    w = random_weight((e, n, k), device, scale_shape=(e, n, 1))
    counts = [5, 0, 12]
    t = sum(counts) + 2
    x = torch.randn(s, k).bfloat16().to(device)
    row_index = torch.randint(0, s, (t,), dtype=torch.int32).to(device)
    offsets = offsets_of(counts, device)
    out = nvfp4_grouped_mm(x, w, offsets, row_index=row_index)
    ref = grouped_f32(x, w, offsets, row_index)
    assert rel_err(out[: sum(counts)].cpu(), ref[: sum(counts)]) < 4e-3
    assert (out[sum(counts):] == 0).all()


@pytest.mark.parametrize("limit", [None, 0.5])
def test_grouped_fused_swiglu(device, limit):
    e, i, k = 3, 24, 64
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    w = interleave_gate_up(plain)
    counts = [4, 19, 0]
    t = sum(counts) + 1
    x = (torch.randn(t, k) * 20).bfloat16().to(device)
    offsets = offsets_of(counts, device)
    out = nvfp4_grouped_mm(x, w, offsets, activation="swiglu", swiglu_limit=limit)
    assert out.shape == (t, i)
    y = grouped_f32(x, plain, offsets)  # [gate; up] layout
    gate, up = y[:, :i], y[:, i:]
    if limit is not None:
        assert (gate.abs() > limit).any(), "the clamp must be exercised"
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    ref = torch.nn.functional.silu(gate) * up
    real = sum(counts)
    assert rel_err(out[:real].cpu(), ref[:real]) < 4e-3
    assert (out[real:] == 0).all()
    # the reference's own swiglu on the interleaved layout agrees
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    assert rel_err(swiglu_reference(inter, limit)[:real], ref[:real]) < 1e-6


def test_grouped_out_buffer_reused(device):
    e, n, k = 2, 32, 64
    w = random_weight((e, n, k), device)
    x = torch.randn(10, k).bfloat16().to(device)
    out = torch.full((10, n), 7.0, dtype=torch.bfloat16, device=device)
    offsets = offsets_of([4, 3], device)
    nvfp4_grouped_mm(x, w, offsets, out=out)
    assert (out[7:] == 0).all()
    assert rel_err(out[:7].cpu(), grouped_f32(x, w, offsets)[:7]) < 4e-3


# ----------------------------------------------------------------------------- GPU


def _dsv4_like(e, n, k, device):
    w = quantize(torch.randn(e, n, k, device=device) * 0.02)
    gs = (torch.rand(e, 1, 1, device=device) + 0.5) * w.global_scale
    return NVFP4Tensor(w.data, w.block_scale, gs, w.shape)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_cuda_grouped_moe_shapes(tokens):
    torch.manual_seed(tokens)
    e, n, k, topk = 32, 512, 1024, 8
    device = torch.device("cuda")
    w = _dsv4_like(e, n, k, device)
    experts = torch.randint(0, e, (tokens * topk,), device=device)
    counts = torch.bincount(experts, minlength=e)
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(tokens * topk, k, device=device).bfloat16()
    out = nvfp4_grouped_mm(x, w, offsets)
    ref = grouped_f32(x, w, offsets)
    assert rel_err(out.cpu(), ref) < 1e-2
    wi = interleave_gate_up(w)
    out = nvfp4_grouped_mm(x, wi, offsets, activation="swiglu", swiglu_limit=7.0)
    y = ref
    ref_sw = torch.nn.functional.silu(y[:, : n // 2].clamp(max=7.0)) * y[:, n // 2 :].clamp(-7.0, 7.0)
    assert rel_err(out.cpu(), ref_sw) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_linear(m):
    device = torch.device("cuda")
    n, k = 1536, 2048
    w = quantize(torch.randn(n, k, device=device) * 0.02)
    x = torch.randn(m, k, device=device).bfloat16()
    out = nvfp4_linear(x, w)
    ref = x.float() @ dequantize(w, torch.float32).t()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.cuda
def test_cuda_sync_free_and_graph_capture():
    device = torch.device("cuda")
    e, n, k, t = 16, 256, 512, 40
    w = _dsv4_like(e, n, k, device)
    wi = interleave_gate_up(w)
    dense = quantize(torch.randn(n, k, device=device) * 0.02)
    x = torch.randn(t, k, device=device).bfloat16()
    experts = torch.randint(0, e, (t,), device=device)
    offsets = torch.bincount(experts, minlength=e).cumsum(0).to(torch.int32)
    row_index = torch.randperm(t, device=device).to(torch.int32)
    out_g = torch.empty(t, n, dtype=torch.bfloat16, device=device)
    out_s = torch.empty(t, n // 2, dtype=torch.bfloat16, device=device)
    out_d = torch.empty(t, n, dtype=torch.bfloat16, device=device)

    def step():
        nvfp4_grouped_mm(x, w, offsets, out=out_g, row_index=row_index)
        nvfp4_grouped_mm(x, wi, offsets, out=out_s, activation="swiglu", swiglu_limit=7.0)
        nvfp4_linear(x, dense, out=out_d)

    step()  # compile outside capture
    torch.cuda.synchronize()
    with no_host_syncs():
        step()
    eager = [o.clone() for o in (out_g, out_s, out_d)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for o in (out_g, out_s, out_d):
        o.zero_()
    # new routing written in place: the graph must follow device values
    x.copy_(torch.randn(t, k, device=device).bfloat16())
    new_experts = torch.randint(0, e, (t - 3,), device=device)
    offsets.copy_(torch.bincount(new_experts, minlength=e).cumsum(0).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    fresh = [o.clone() for o in (out_g, out_s, out_d)]
    step()
    for a, b in zip(fresh, (out_g, out_s, out_d)):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], fresh[0])


@pytest.mark.parametrize("grouped", [False, True])
def test_decode_is_bit_exact(device, grouped):
    """x = identity rows, global scale 1: the output is the decoded weight itself, which is exact in bf16.

    Covers every E2M1 code (the 0.5 code is the delicate one in the bit trick),
    normal and subnormal E4M3 scales and a negative scale byte (NaN blocks: see the NaN test).
    """
    n, k = 32, 64
    codes = torch.arange(n * k) % 16
    data = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(n, k // 2)
    scale_bytes = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x3F, 0xB8, 0x45, 0x11, 0x02])
    scale = scale_bytes[torch.arange(n * k // 16) % len(scale_bytes)].to(torch.uint8).reshape(n, k // 16)
    w = NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.tensor(1.0), (n, k))
    expect = dequantize(w, torch.float32).t()  # (K, N): row m of x = e_m picks column m of W^T
    x = torch.eye(k).bfloat16()
    if grouped:
        wg = NVFP4Tensor(data[None], w.block_scale[None], torch.ones(1, 1, 1), (1, n, k)).to(device)
        out = nvfp4_grouped_mm(x.to(device), wg, torch.tensor([k], dtype=torch.int32, device=device))
    else:
        out = nvfp4_linear(x.to(device), w.to(device))
    torch.testing.assert_close(out.cpu().float(), expect, rtol=0, atol=0, equal_nan=True)
