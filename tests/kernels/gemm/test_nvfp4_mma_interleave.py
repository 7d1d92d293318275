"""The row-interleaved weight layout (``NVFP4Tensor.interleave_rows``, ``weight_interleave=4``) in the
mma.sync decode kernel: every path (register double-buffering, the cp.async weight ring, x through shared memory,
split-K) writes the same bits as the row-major layout, and the argument is checked."""
import subprocess

import pytest
import torch

from gemm_helpers import grouped_f32, offsets_of, random_weight, rel_err

from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE


def test_mma_weight_interleave_argument_is_checked():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    scale = torch.zeros(2, 6, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for bad, n in ((2, 8), (4, 6), (8, 8)):
        with pytest.raises(ValueError, match="weight_interleave"):
            mma.launch_nvfp4_mma_decode(x, torch.zeros(2, n, 128, dtype=torch.uint8), scale, torch.ones(()),
                                        torch.empty(4, n), expert_offsets=torch.tensor([2, 4], dtype=torch.int32),
                                        weight_interleave=bad)


@pytest.mark.cuda
@pytest.mark.parametrize("config,kwargs", [
    ((8, 128, 256, 4), {}),  # the decode band's config: register double-buffering, 256-K steps
    ((16, 128, 128, 4, 4), {}),  # MMA16_CONFIG: the cp.async weight ring
    ((32, 128, 128, 4), dict(x_smem=(32,))),  # x through shared memory
    ((8, 128, 256, 4), dict(splits=3)),  # split-K (single-launch reduction)
])
def test_cuda_mma_interleaved_weights_same_bits(config, kwargs):
    device = torch.device("cuda")
    counts = [0, 1, 3, 8, 5, 30]
    e, n, k = len(counts), 328, 1536
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    w4 = w.interleave_rows(4)
    data_il, scale_il = w4.data, w4.block_scale
    t = sum(counts) + 2
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    args = dict(expert_offsets=offsets, row_index=row_index, config=config, max_rows_per_expert=max(counts), **kwargs)
    plain = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    inter = plain.clone()
    mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, plain, **args)
    mma.launch_nvfp4_mma_decode(x, data_il, scale_il, w.global_scale, inter, weight_interleave=4, **args)
    assert torch.equal(inter, plain)
    ref = grouped_f32(x, w, offsets, row_index)
    assert rel_err(plain[:sum(counts)], ref[:sum(counts)]) < 4e-3
    mma.launch_nvfp4_mma_decode(x, data_il, scale_il, w.global_scale, inter, **args)  # read as row-major
    assert not torch.equal(inter, plain)


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("flags", [dict(swiglu=True), dict(row_index=False), dict(swiglu=True, split=1)])
def test_sm90_interleaved_decode_build_keeps_three_programs_per_sm(tmp_path, flags):
    """The decode config's interleaved builds fit 168 registers (3 programs of 4 warps per SM, as row-major): the
    gathered SwiGLU build needs the INTERLEAVED_MAXNREG cap for it (170 without), and its K loop does not spill."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    config = mma.MMA_DECODE_CONFIGS[4]
    assert tuple(config) == (8, 128, 256, 4) and mma.INTERLEAVED_MAXNREG[tuple(config)] == 168
    cubin = tk._compile_in_subprocess(config, dict(flags, weight_interleave=4), tmp_path)
    path = tmp_path / "res.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
    regs = int(usage.split("REG:")[1].split()[0])
    assert regs <= 168 and mma.resident_programs(regs, 4, 0) >= 3, usage
    assert "LOCAL:0" in usage, usage
    loops = [ops for _, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
    assert len(loops) == 1 and not loops[0]["LDL"] and not loops[0]["STL"], loops


@pytest.mark.cuda
@pytest.mark.parametrize("interleave", [1, 4])
def test_cuda_one_wave_config_same_bits(interleave):
    """The 8-warp one-wave decode config (16 weight rows per warp instead of 32, under its 128-register cap) runs the
    same MMAs in the same K order as the 4-warp decode config: the same bits, gathered SwiGLU and plain, with empty
    experts, one 8-row chunk and padding rows."""
    device = torch.device("cuda")
    counts = [0, 1, 3, 8, 5, 0, 7, 2]
    e, n, k = len(counts), 520, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    if interleave > 1:
        w = w.interleave_rows(interleave)
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    for swiglu, index in ((True, row_index), (False, None)):
        width = n // 2 if swiglu else n
        outs = []
        for config in (mma.MMA_DECODE_CONFIGS[4], mma.MMA_DECODE_ONE_WAVE_CONFIG):
            out = torch.full((t, width), float("nan"), dtype=torch.bfloat16, device=device)
            mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                        row_index=index, swiglu=swiglu, config=config, max_rows_per_expert=8,
                                        weight_interleave=interleave)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert not outs[0].isnan().any()


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("flags", [dict(swiglu=True), dict(row_index=False)])
def test_sm90_one_wave_build_fits_two_programs_per_sm(tmp_path, interleave, flags):
    """The one-wave config's builds take at most 128 registers (2 programs of 8 warps per SM) without spilling."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    config = mma.MMA_DECODE_ONE_WAVE_CONFIG
    cubin = tk._compile_in_subprocess(config, dict(flags, weight_interleave=interleave), tmp_path)
    path = tmp_path / "res.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
    regs = int(usage.split("REG:")[1].split()[0])
    assert regs <= 128 and mma.resident_programs(regs, 8, 0) == 2, usage
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
    loops = [ops for _, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
    assert len(loops) == 1 and not loops[0]["LDL"] and not loops[0]["STL"], loops


@pytest.mark.cuda
@pytest.mark.parametrize("config,kwargs", [
    ((8, 128, 256, 4), dict(weight_interleave=4)),  # the decode band's config
    ((8, 128, 256, 8), dict(weight_interleave=4)),  # the one-wave config
    ((32, 128, 128, 4), {}),  # the 32-row band, 128-K steps
    ((8, 128, 256, 4), dict(splits=3)),  # split-K partials
])
def test_cuda_x_paired_same_bits(config, kwargs):
    """x in the paired order (``x_paired=True``, no byte permutes in the kernel) runs the same MMAs in the same K
    order as the plain x: the same bits, gathered SwiGLU and plain, with empty experts and padding rows; the paired x
    read as plain (or the plain x read as paired) gives other values."""
    from megamoe.format.mma_order import to_paired_order

    device = torch.device("cuda")
    counts = [0, 1, 3, 8, 5, 0, 7, 2]
    e, n, k = len(counts), 520, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    if kwargs.get("weight_interleave", 1) > 1:
        w = w.interleave_rows(kwargs["weight_interleave"])
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    xp = to_paired_order(x)
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    for swiglu, index in ((True, row_index), (False, None)):
        width = n // 2 if swiglu else n
        outs = []
        for xin, paired in ((x, False), (xp, True), (x, True)):
            out = torch.full((t, width), float("nan"), dtype=torch.bfloat16, device=device)
            mma.launch_nvfp4_mma_decode(xin, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                        row_index=index, swiglu=swiglu, config=config, max_rows_per_expert=8,
                                        x_paired=paired, **kwargs)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert not outs[0].isnan().any()
        assert not torch.equal(outs[2][:sum(counts)], outs[0][:sum(counts)])


def test_x_paired_refuses_the_shared_memory_paths():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    scale = torch.zeros(2, 8, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_paired"):
        mma.launch_nvfp4_mma_decode(x, torch.zeros(2, 8, 128, dtype=torch.uint8), scale, torch.ones(()),
                                    torch.empty(4, 8), expert_offsets=torch.tensor([2, 4], dtype=torch.int32),
                                    config=(32, 128, 128, 4), x_smem=(32,), x_paired=True)


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
def test_sm90_x_paired_drops_the_x_byte_permutes(tmp_path):
    """Offline sm_90: the paired build of the one-wave gathered SwiGLU config has 32 fewer PRMT per K step (two per
    MMA: the B operand's pairs) and the same MMAs and loads, within the same 128-register cap, without spills."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    loops, regs = {}, {}
    for paired in (False, True):
        flags = dict(swiglu=True, weight_interleave=4, x_paired=paired)
        cubin = tk._compile_in_subprocess(mma.MMA_DECODE_ONE_WAVE_CONFIG, flags, tmp_path)
        path = tmp_path / "res.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
        regs[paired] = int(usage.split("REG:")[1].split()[0])
        assert "LOCAL:0" in usage, usage
        (loops[paired],) = [ops for _, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
    plain, paired = loops[False], loops[True]
    assert plain["HMMA"] == paired["HMMA"] == 16 and plain["LDG"] == paired["LDG"]
    assert plain["PRMT"] - paired["PRMT"] == 32, (plain, paired)
    assert max(regs.values()) <= 128, regs
