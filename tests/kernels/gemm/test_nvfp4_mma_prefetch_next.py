"""The decode band's L2 prefetch of the next GEMM's weights (``prefetch_next``, the kernel's PF_NEXT; issue 11,
NOTES_gemm.md v26): the host plan keeps every prefetched run inside its expert's weights, the op checks the
argument, the kernel writes the same bits with it on (it moves no math), and the builds issue the bulk prefetch
without spilling in the K loop."""
import subprocess

import pytest
import torch

from gemm_helpers import check_sync_free_and_graph, grouped_f32, offsets_of, random_weight, rel_err

from megamoe.format.tensor import NVFP4Tensor
from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE
from megamoe.ops import gemm as gemm_ops


def _next(e, n2, k2):
    return (torch.zeros(e, n2, k2 // 2, dtype=torch.uint8),
            torch.zeros(e, n2, k2 // 16, dtype=torch.uint8).view(torch.float8_e4m3fn))


@pytest.mark.parametrize("experts,n_tiles,warps,budget", [(7, 32, 4, 32 << 20), (56, 32, 4, 32 << 20),
                                                           (3, 5, 4, 1 << 40), (9, 7, 8, 3 << 20)])
def test_prefetch_pieces_stay_inside_each_expert_and_budget(experts, n_tiles, warps, budget):
    data, scale = _next(4, 4096, 2048)
    w_piece, s_piece = mma.prefetch_next_pieces(data, scale, experts, n_tiles, warps, budget)
    runs = n_tiles * warps
    assert w_piece % 16 == 0 and s_piece % 16 == 0 and w_piece >= 16 and s_piece >= 16
    assert runs * w_piece <= data.stride(0) and runs * s_piece <= scale.stride(0)  # never past the expert
    assert experts * runs * (w_piece + s_piece) <= budget  # within the L2 budget over the touched experts
    if budget >= experts * (data.stride(0) + scale.stride(0)):  # the whole expert, up to the 16-byte rounding
        assert data.stride(0) - runs * w_piece < 16 * runs and scale.stride(0) - runs * s_piece < 16 * runs


def test_prefetch_pieces_off_when_not_possible():
    data, scale = _next(4, 256, 512)
    assert mma.prefetch_next_pieces(data, scale, 4, 2, 4, 0) is None  # no budget
    assert mma.prefetch_next_pieces(data, scale, 4, 2, 4, 100) is None  # runs under 16 bytes
    assert mma.prefetch_next_pieces(data[:, :, :100], scale, 4, 2, 4, 1 << 30) is None  # not contiguous
    assert mma.prefetch_next_pieces(data.view(torch.int32), scale, 4, 2, 4, 1 << 30) is None  # not bytes
    assert mma.prefetch_next_pieces(data[0], scale[0], 4, 2, 4, 1 << 30) is None  # not (E, N2, K2)
    odd, odd_scale = _next(4, 3, 32)  # a 48-byte expert run: fine; 3-row scales: 6 bytes per expert, not aligned
    assert mma.prefetch_next_pieces(odd, odd_scale, 4, 1, 1, 1 << 30) is None
    assert mma.prefetch_next_pieces(data, scale, 4, 2, 4, 1 << 30) == (256 * 256 // 8, 256 * 32 // 8)


def test_grouped_mm_prefetch_next_argument_is_checked():
    x = torch.randn(4, 256).bfloat16()
    w = random_weight((2, 64, 256), torch.device("cpu"))
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="prefetch_next"):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, prefetch_next=w.data)
    other = random_weight((3, 256, 64), torch.device("cpu"))
    with pytest.raises(ValueError, match="prefetch_next"):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, prefetch_next=other)
    nxt = random_weight((2, 256, 64), torch.device("cpu"))
    assert torch.equal(gemm_ops.nvfp4_grouped_mm(x, w, offsets, prefetch_next=nxt),
                       gemm_ops.nvfp4_grouped_mm(x, w, offsets))  # a hint: the CPU path ignores it
    assert isinstance(nxt, NVFP4Tensor)


@pytest.mark.cuda
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("evict_last", [False, True])
def test_cuda_prefetch_next_same_bits(interleave, evict_last):
    device = torch.device("cuda")
    counts = [0, 1, 3, 8, 5, 0, 7, 2]  # empty experts, one full 8-row chunk, padding rows after
    e, n, k, n2, k2 = len(counts), 520, 1024, 256, 1536
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    nxt = random_weight((e, n2, k2), device)
    if interleave > 1:
        w, nxt = w.interleave_rows(interleave), nxt.interleave_rows(interleave)
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    args = dict(expert_offsets=offsets, row_index=row_index, config=mma.MMA_DECODE_CONFIGS[4],
                max_rows_per_expert=max(counts), swiglu=True, weight_interleave=interleave)
    plain = torch.full((t, n // 2), float("nan"), dtype=torch.bfloat16, device=device)
    hinted = plain.clone()
    mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, plain, **args)
    for budget in (1 << 30, 64 << 10):  # every expert whole; a share of each
        mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, hinted, **args,
                                    prefetch_next=(nxt.data, nxt.block_scale, budget, evict_last))
        assert torch.equal(hinted, plain)
    rows = sum(counts)
    ref = grouped_f32(x, w.rows_in_order(), offsets, row_index)
    gate, up = ref[:rows, 0::2], ref[:rows, 1::2]
    assert rel_err(plain[:rows].float(), torch.nn.functional.silu(gate) * up) < 2e-2


@pytest.mark.cuda
def test_cuda_op_prefetch_next_graph_replay_sync_free(monkeypatch):
    """Through ``nvfp4_grouped_mm`` (the banded route's decode band) with the budget on: sync-free, graph replay ==
    eager after the routing moved, and the same bits as without the hint."""
    device = torch.device("cuda")
    monkeypatch.setattr(gemm_ops, "DECODE_PREFETCH_NEXT_BYTES", 32 << 20)
    e, n, k = 16, 512, 2048
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1)).interleave_rows(4)
    nxt = random_weight((e, k, n // 2), device).interleave_rows(4)
    t = 14
    x = torch.randn(t, k, device=device).bfloat16()
    offsets = offsets_of([1] * t + [0] * (e - t), device)
    out = torch.empty(t, n // 2, dtype=torch.bfloat16, device=device)

    def launch():
        return gemm_ops.nvfp4_grouped_mm(x, w, offsets, out=out, activation="swiglu", max_rows_per_expert=2,
                                         prefetch_next=nxt)

    check_sync_free_and_graph(launch, x, offsets, t)
    hinted = launch().clone()
    monkeypatch.setattr(gemm_ops, "DECODE_PREFETCH_NEXT_BYTES", 0)
    assert torch.equal(hinted, launch())


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("interleave", [1, 4])
def test_sm90_prefetch_build_issues_bulk_prefetch_and_keeps_the_k_loop(tmp_path, interleave):
    """PF_NEXT builds of the decode config: two bulk prefetches (UBLKPF: weights and scales) outside the K loop,
    three programs per SM as the default build, and no local memory traffic in the K loop; the default build has
    none."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    config = mma.MMA_DECODE_CONFIGS[4]
    for pf in (0, 2):
        cubin = tk._compile_in_subprocess(config, dict(swiglu=True, weight_interleave=interleave, prefetch_next=pf),
                                          tmp_path)
        path = tmp_path / "pf.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([tk._cuobjdump(), "-sass", str(path)], capture_output=True, text=True).stdout
        usage = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
        assert sass.count("UBLKPF") == (2 if pf else 0)
        regs = int(usage.split("REG:")[1].split()[0])
        assert mma.resident_programs(regs, 4, 0) >= 3, usage
        loops = [ops for _, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
        assert len(loops) == 1 and not loops[0]["LDL"] and not loops[0]["STL"], loops
