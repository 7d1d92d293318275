"""The mma.sync decode kernel's x through shared memory (``X_SMEM`` / ``MEGAMOE_MMA_X_SMEM``;
megamoe/kernels/gemm/nvfp4_mma_decode.py): x put in the MMA K order once (megamoe/format/mma_order.py), copied
by cp.async one step ahead and read back with ldmatrix. Same MMAs and K order as today's register path, so the
``cuda`` tests require today's bits. On CPU: the offline sm_90 K loop (fewer instructions per weight, fewer
registers, no spills) at the BLOCK_M 32 band config.
"""
import pytest
import torch

from gemm_helpers import (
    assert_exact_decode,
    check_sync_free_and_graph,
    grouped_f32,
    offsets_of,
    random_weight,
    rel_err,
    uniform_offsets,
    v4_flash_gate_up_case,
)
from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from test_nvfp4_gluon import _compile_in_subprocess, _cuobjdump, _inner_loops, gluon_only


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
def test_sm90_x_smem_k_loop(tmp_path):
    """(32, 128, 128, 4) + SwiGLU: 3.84 instructions per weight (today 4.66): x comes as 4 cp.async and 16
    ldmatrix per step instead of 16 LDG.128 + 64 PRMTs; no spills."""
    config = (32, 128, 128, 4)
    loops = _inner_loops(_compile_in_subprocess(config, dict(swiglu=True, x_smem=True), tmp_path), tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    assert ops["HMMA"] == (128 // 4 // 16) * (128 // 16) * (32 // 8)
    assert ops["LDGSTS"] == 32 * 128 * 2 // 16 // 128 and ops["LDSM"] == 16
    assert ops["PRMT"] <= 40 and not ops["LDL"] and not ops["STL"]
    assert count / (128 * 128 // 128) <= 3.84 * 1.05, (count, ops)


def _both(x, w, out_shape, config, **kwargs):
    """(today's register path, x through shared memory) outputs of the same launch."""
    outs = []
    for x_smem in (frozenset(), frozenset({config[0]})):
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device=x.device)
        mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, config=config, x_smem=x_smem,
                                    **kwargs)
        outs.append(out)
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("config", [(32, 128, 128, 4), (16, 128, 128, 4), (8, 128, 256, 4)])
@pytest.mark.parametrize("counts", [[0, 40, 7, 0, 33], [90, 0, 0, 0], [1, 2, 3, 4]])
def test_cuda_x_smem_equals_today(config, counts):
    device = torch.device("cuda")
    e, n, k = len(counts), 200, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 5
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    today, smem = _both(x, w, (t, n), config, expert_offsets=offsets_of(counts, device), row_index=row_index)
    assert torch.equal(smem, today)
    real = sum(counts)
    assert rel_err(smem[:real], grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)[:real]) < 4e-3
    # an out-of-range row_index value reads zeros on both paths (x through shared memory read row 0 until
    # 2026-11-26)
    row_index[1] = -3
    today, smem = _both(x, w, (t, n), config, expert_offsets=offsets_of(counts, device), row_index=row_index)
    assert torch.equal(smem, today)
    if real > 1:
        assert (smem[1] == 0).all()


@pytest.mark.cuda
def test_cuda_x_smem_swiglu_v4_shape_dense_and_exact_decode():
    device = torch.device("cuda")
    counts = [64, 33, 1, 0, 17, 32, 2, 50]  # V4-Flash gate_up, experts of 1..64 rows
    x, w, i = v4_flash_gate_up_case(counts, device)
    t = sum(counts)
    today, smem = _both(x, w, (t, i), (32, 128, 128, 4), expert_offsets=offsets_of(counts, device), swiglu=True,
                        swiglu_limit=7.0)
    assert torch.equal(smem, today)
    dense = random_weight((136, 1024), device)
    xd = torch.randn(40, 1024, device=device).bfloat16()
    today, smem = _both(xd, dense, (40, 136), (32, 128, 128, 4), bias=torch.randn(136, device=device).bfloat16())
    assert torch.equal(smem, today)
    assert_exact_decode(lambda x, w, out, offsets: mma.launch_nvfp4_mma_decode(
        x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, config=(32, 128, 128, 4),
        x_smem={32}), 128, 256, device)


@pytest.mark.cuda
def test_cuda_x_smem_sync_free_and_graph():
    device = torch.device("cuda")
    e, n, k, t = 16, 256, 512, 400
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t, k, device=device).bfloat16()
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)

    def launch():
        return mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                           config=(32, 128, 128, 4), x_smem={32})

    launch()
    check_sync_free_and_graph(launch, x, offsets, t)
    assert rel_err(out, grouped_f32(x, w, offsets)) < 1e-2
