"""The wgmma prefill kernel's x ring (NOTES_gemm.md v16, ``X_RING`` / ``MEGAMOE_WGMMA_X_RING``;
megamoe/kernels/gemm/nvfp4_wgmma.py).

x is put in the MMA K order once (megamoe/format/mma_order.py) and streamed by cp.async into a shared-memory ring;
the wgmma chain is asynchronous. The MMAs, their K order and operands are those of today's loop, so the ``cuda``
tests require the same bits as the synchronous kernel (plus the float32 reference where it adds coverage). On
CPU: the offline sm_90 build's K loop (no spills, no wait-for-all, fewer instructions per weight than today's).
Sync-free + graph replay: ``test_nvfp4_gluon.py::test_cuda_wgmma_sync_free_and_graph[4]``.
"""
import pytest
import torch

from gemm_helpers import (
    SKEWED_COUNTS_16,
    assert_exact_decode,
    grouped_f32,
    offsets_of,
    random_weight,
    rel_err,
    v4_flash_gate_up_case,
)
from megamoe.kernels.gemm import nvfp4_wgmma as wgmma
from test_nvfp4_gluon import _compile_in_subprocess, _cuobjdump, _inner_loops, gluon_only


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("swiglu", [True, False])
def test_sm90_x_ring_k_loop(tmp_path, swiglu):
    """Unrolled by the ring size (4): 8 wgmma per step, none waited to zero in the loop, no x loads or
    shared-memory stores (cp.async only), no spills; measured 3.72 (SwiGLU) / 3.73 instructions per weight
    (today's loop 4.19; the peer's 3.70)."""
    block_m, block_n, block_k, num_warps, _ = config = wgmma.WGMMA_CONFIG
    loops = _inner_loops(_compile_in_subprocess(config, dict(swiglu=swiglu, x_ring=4), tmp_path, kind="wgmma"),
                         tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HGMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    steps = 4
    assert ops["HGMMA"] == steps * block_k // 16
    assert ops["LDGSTS"] == steps * block_m * block_k * 2 // 16 // (32 * num_warps)  # 16-byte x copies only
    assert not ops["LDL"] and not ops["STL"] and not ops["STS"] and not ops["STSM"] and not ops["SHFL"]
    assert ops["WARPGROUP"] == 2 * steps  # one arrive and one wait (for all but one in flight) per step
    assert count / (steps * block_n * block_k // (32 * num_warps)) <= 3.73 * 1.05, (count, ops)


def _both(x, w, out_shape, **kwargs):
    """(today's loop, the x ring) outputs of the same launch."""
    outs = []
    for ring in (0, 4):
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device=x.device)
        wgmma.launch_nvfp4_wgmma(x, w.data, w.block_scale, w.global_scale, out, x_ring=ring, **kwargs)
        outs.append(out)
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("counts", [[0, 300, 7, 0, 129], [600, 0, 0, 0], [1, 2, 3, 4]])
def test_cuda_x_ring_equals_today_grouped_row_index(counts):
    device = torch.device("cuda")
    e, n, k = len(counts), 200, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 5  # padding rows
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    today, ring = _both(x, w, (t, n), expert_offsets=offsets_of(counts, device), row_index=row_index)
    assert torch.equal(ring, today)
    real = sum(counts)
    assert (ring[real:] == 0).all()
    assert rel_err(ring[:real], grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)[:real]) < 4e-3
    # an out-of-range row_index value reads zeros in both loops (the ring read row 0 until 2026-11-26)
    row_index[1] = t + 7
    today, ring = _both(x, w, (t, n), expert_offsets=offsets_of(counts, device), row_index=row_index)
    assert torch.equal(ring, today)
    if real > 1:
        assert (ring[1] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [None, 7.0])
def test_cuda_x_ring_swiglu_v4_flash_shape_skewed(limit):
    """V4-Flash gate_up (H = 4096, I = 2048) of 16 experts, Zipf-like rows (one hot expert), SwiGLU."""
    device = torch.device("cuda")
    counts = SKEWED_COUNTS_16
    x, w, i = v4_flash_gate_up_case(counts, device)
    t = sum(counts)
    today, ring = _both(x, w, (t, i), expert_offsets=offsets_of(counts, device), swiglu=True, swiglu_limit=limit)
    assert torch.equal(ring, today)


@pytest.mark.cuda
def test_cuda_x_ring_dense_bias_exact_decode_and_fallback():
    device = torch.device("cuda")
    dense = random_weight((136, 1024), device)
    xd = torch.randn(300, 1024, device=device).bfloat16()
    bias = torch.randn(136, device=device).bfloat16()
    today, ring = _both(xd, dense, (300, 136), bias=bias)
    assert torch.equal(ring, today)
    # every code through an identity: exact decode in the MMA K order
    assert_exact_decode(lambda x, w, out, offsets: wgmma.launch_nvfp4_wgmma(
        x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, x_ring=4), 128, 512, device)
    # K = 384 is not a multiple of 4 x 128: today's loop runs, same bits
    w3 = random_weight((2, 96, 384), device, scale_shape=(2, 1, 1))
    x3 = torch.randn(50, 384, device=device).bfloat16()
    today, ring = _both(x3, w3, (50, 96), expert_offsets=offsets_of([20, 30], device))
    assert torch.equal(ring, today)
    with pytest.raises(ValueError, match="x_ring"):
        wgmma.launch_nvfp4_wgmma(x3, w3.data, w3.block_scale, w3.global_scale, ring,
                                 expert_offsets=offsets_of([20, 30], device), x_ring=3)

