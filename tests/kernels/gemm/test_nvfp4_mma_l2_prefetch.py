"""The mma.sync decode kernel's L2 prefetch (``L2_PREFETCH`` / ``l2_prefetch``, NOTES_gemm.md v25): it moves no
math (the same bits at every distance, on every register-buffered path), stays graph-capturable and sync-free, and
its builds carry the prefetches in the K loop without spilling or losing residency.

A prefetch to a wrong address cannot change a result, so these tests cannot catch one; the offline test pins that
the K loop issues them, and the A/B benchmark (``benchmarks/ab_mma_l2_prefetch.py``) measures whether they pay."""
import subprocess

import pytest
import torch

from gemm_helpers import check_sync_free_and_graph, grouped_f32, offsets_of, random_weight, rel_err

from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE


@pytest.mark.cuda
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("config,kwargs", [
    ((8, 128, 256, 4), {}),  # the decode band's config
    ((8, 128, 256, 4), dict(splits=3)),  # split-K (single-launch reduction): prefetches start at the split's K
    ((32, 128, 128, 4), {}),  # BLOCK_K 128: one 64-byte piece per row and step
])
def test_cuda_l2_prefetch_same_bits(config, kwargs, interleave):
    device = torch.device("cuda")
    counts = [0, 1, 3, 8, 5, 30, 0, 2]  # empty experts, a chunk past BLOCK_M 8 and 32
    e, n, k = len(counts), 328, 1536  # N not a multiple of BLOCK_N; 6 or 12 K steps
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    if interleave > 1:
        w = w.interleave_rows(interleave)
    t = sum(counts) + 3  # padding rows
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    outs = []
    for distance in (0, 2, 5, 16):  # 16: past the last step of every item (clamped)
        out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
        mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                    row_index=row_index, config=config, max_rows_per_expert=max(counts),
                                    weight_interleave=interleave, l2_prefetch=distance, **kwargs)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    if interleave == 1:
        ref = grouped_f32(x, w, offsets, row_index)
        assert rel_err(outs[0][:sum(counts)], ref[:sum(counts)]) < 4e-3
    assert torch.equal(outs[0][sum(counts):], torch.zeros_like(outs[0][sum(counts):]))


@pytest.mark.cuda
def test_cuda_l2_prefetch_graph_replay_and_sync_free():
    device = torch.device("cuda")
    e, n, k, t = 6, 256, 1024, 12
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1)).interleave_rows(4)
    x = torch.randn(t, k, device=device).bfloat16()
    offsets = offsets_of([2, 0, 5, 1, 4, 0], device)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)

    def launch():
        return mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                           config=(8, 128, 256, 4), weight_interleave=4, l2_prefetch=6,
                                           max_rows_per_expert=t)

    check_sync_free_and_graph(launch, x, offsets, t)


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("flags", [dict(swiglu=True), dict(swiglu=True, split=1), dict(row_index=False)])
def test_sm90_l2_prefetch_build(tmp_path, flags):
    """The decode config's interleaved builds with a prefetch distance: 3 prefetches per K step in the loop (two
    64-byte pieces per weight row, one scale row per thread), no spill, still 3 programs per SM."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    cubin = tk._compile_in_subprocess(mma.MMA_DECODE_CONFIGS[4], dict(flags, weight_interleave=4, l2_prefetch=6),
                                      tmp_path)
    path = tmp_path / "pf.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
    regs = int(usage.split("REG:")[1].split()[0])
    assert mma.resident_programs(regs, 4, 0) >= 3 and "LOCAL:0" in usage, usage
    loops = [ops for _, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
    assert len(loops) == 1 and loops[0]["CCTL"] == 3 and not loops[0]["LDL"], loops
