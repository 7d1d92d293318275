"""Decode-shaped NVFP4 GEMMs (megamoe/kernels/gemm/nvfp4_gemv.py) against float32 math on the decoded weights.

On CPU these run through the Triton interpreter with the tiny interpreter config
(ROWS=2, BLOCK_N=16, BLOCK_K=64), so the shapes cross the N and K tile edges,
give experts more rows than ROWS and leave padding rows. The ``cuda`` tests run
the production configs, the no-host-sync check and CUDA-graph capture/replay.
"""
import pytest
import torch

from gemm_helpers import check_sync_free_and_graph, grouped_f32, offsets_of, random_weight, rel_err
from megamoe.format.tensor import NVFP4Tensor
from megamoe.kernels.gemm.nvfp4_gemv import launch_nvfp4_gemv
from megamoe.ops._dispatch import use_triton
from megamoe.reference.gemm import interleave_gate_up, swiglu_reference
from megamoe.reference.quantize import dequantize, quantize


def _grouped_f32(x, w, counts, row_index=None):
    return grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)


def _launch(x, w, out, offsets=None, **kw):
    return launch_nvfp4_gemv(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                             interpreter=not x.is_cuda, **kw)


def test_kernel_path_is_used(device):
    assert use_triton(torch.empty(1, device=device))


@pytest.mark.parametrize("counts", [[1, 0, 5, 1], [0, 0, 0, 0], [3, 3, 0, 1], [0, 0, 0, 2]])
def test_grouped_matches_float32(device, counts):
    e, n, k = len(counts), 40, 96  # N, K not multiples of the tile (16, 64)
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    pad = 3
    t = sum(counts) + pad
    x = torch.randn(t, k).bfloat16().to(device)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of(counts, device))
    real = sum(counts)
    assert torch.equal(out[real:].cpu(), torch.zeros(pad, n, dtype=torch.bfloat16)), "padding rows must be 0"
    if real:
        assert rel_err(out[:real], _grouped_f32(x, w, counts)[:real]) < 4e-3


def test_grouped_row_index_per_row_scale(device):
    e, n, k, s = 3, 32, 128, 7
    w = random_weight((e, n, k), device, scale_shape=(e, n, 1))
    counts = [2, 0, 3]
    t = sum(counts) + 1
    x = torch.randn(s, k).bfloat16().to(device)
    row_index = torch.randint(0, s, (t,), dtype=torch.int32).to(device)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of(counts, device), row_index=row_index)
    assert rel_err(out[:5], _grouped_f32(x, w, counts, row_index)[:5]) < 4e-3
    assert (out[5:] == 0).all()


@pytest.mark.parametrize("limit", [None, 0.5])
def test_grouped_swiglu(device, limit):
    e, i, k = 2, 24, 64
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    counts = [3, 1]
    t = sum(counts) + 1
    x = (torch.randn(t, k) * 20).bfloat16().to(device)
    out = torch.empty(t, i, dtype=torch.bfloat16, device=device)
    _launch(x, interleave_gate_up(plain), out, offsets_of(counts, device), swiglu=True, swiglu_limit=limit)
    y = _grouped_f32(x, plain, counts)
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    if limit is not None:
        assert (y.abs() > limit).any()
    ref = swiglu_reference(inter, limit)
    assert rel_err(out[:4], ref[:4]) < 4e-3
    assert (out[4:] == 0).all()


@pytest.mark.parametrize("m", [1, 3])
def test_dense_with_bias_and_nan_block(device, m):
    n, k = 24, 160
    src = torch.randn(n, k) * 0.05
    src[5, 16:32] = float("nan")
    w = quantize(src, per_row=True).to(device)
    x = torch.randn(m, k).bfloat16().to(device)
    bias = torch.randn(n).bfloat16().to(device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, bias=bias)
    ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t() + bias.float().cpu()
    keep = torch.arange(n) != 5
    assert torch.isnan(out[:, 5].cpu()).all()
    assert rel_err(out[:, keep], ref[:, keep]) < 4e-3


def test_decode_is_exact(device):
    """x = identity rows, global scale 1: out = the decoded weight bit for bit (every code, odd scales)."""
    n, k = 16, 64
    codes = torch.arange(n * k) % 16
    data = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(1, n, k // 2)
    sb = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x3F, 0xB8, 0x45, 0x11, 0x02])
    scale = sb[torch.arange(n * k // 16) % len(sb)].to(torch.uint8).reshape(1, n, k // 16)
    w = NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.ones(1, 1, 1), (1, n, k)).to(device)
    out = torch.empty(k, n, dtype=torch.bfloat16, device=device)
    _launch(torch.eye(k).bfloat16().to(device), w, out, torch.tensor([k], dtype=torch.int32, device=device))
    expect = dequantize(w.to("cpu"), torch.float32)[0].t()
    torch.testing.assert_close(out.cpu().float(), expect, rtol=0, atol=0)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_cuda_moe_shapes_and_graph(tokens):
    device = torch.device("cuda")
    torch.manual_seed(tokens)
    e, n, k = 32, 512, 1024
    w = random_weight((e, n, k), "cpu", scale_shape=(e, 1, 1)).to(device)
    t = 8 * tokens
    counts = torch.bincount(torch.randint(0, e, (t,)), minlength=e)
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    x = torch.randn(t + 2, k, device=device).bfloat16()  # 2 padding rows
    out = torch.full((t + 2, n), 3.0, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets)
    assert rel_err(out[:t], _grouped_f32(x, w, counts.tolist())[:t]) < 1e-2
    assert (out[t:] == 0).all()
    new_counts = check_sync_free_and_graph(lambda: _launch(x, w, out, offsets), x, offsets, t)
    assert rel_err(out[:t], _grouped_f32(x, w, new_counts.tolist())[:t]) < 1e-2


def test_routing_rule_is_a_host_shape_bucket():
    from megamoe.kernels.gemm.nvfp4_gemv import GEMV_MAX_DENSE_ROWS, GEMV_MAX_ROWS_PER_EXPERT, gemv_preferred

    e = 256
    assert gemv_preferred(8, e, 4096, 7168)  # 1 token, top-8
    assert gemv_preferred(GEMV_MAX_ROWS_PER_EXPERT * e, e, 4096, 7168)
    assert not gemv_preferred(GEMV_MAX_ROWS_PER_EXPERT * e + 1, e, 4096, 7168)
    assert not gemv_preferred(32768, e, 4096, 7168)  # prefill stays on the tensor cores
    assert gemv_preferred(1, None, 1536, 2048) and not gemv_preferred(GEMV_MAX_DENSE_ROWS + 1, None, 1536, 2048)
    assert not gemv_preferred(1, e, 64, 48)  # K not a multiple of 32
