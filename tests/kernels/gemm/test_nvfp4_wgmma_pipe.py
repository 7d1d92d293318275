"""The pipelined wgmma grouped GEMM (megamoe/kernels/gemm/nvfp4_wgmma_pipe.py, NOTES_gemm.md v17).

On CPU: the offline sm_90 build's K loop (asynchronous wgmma chain that ptxas did not serialise, weights and x
through cp.async only, no spills in the loop). On the GPU (``cuda``): against the float32 reference on skewed
routings with empty experts, row counts that are not multiples of the tile, padding rows and N not a multiple
of the 256-row tile; exact decode of every code; the row_index guard; through ``nvfp4_grouped_mm`` with the
route switched on; sync-free and graph replay == eager.
"""
import pytest
import torch

from gemm_helpers import (
    SKEWED_COUNTS_16,
    assert_exact_decode,
    check_sync_free_and_graph,
    grouped_f32,
    offsets_of,
    random_weight,
    rel_err,
    uniform_offsets,
    v4_flash_gate_up_case,
)
from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe
from megamoe.reference.gemm import swiglu_reference
from test_nvfp4_gluon import _compile_in_subprocess, _cuobjdump, _inner_loops, gluon_only


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("swiglu", [True, False])
def test_sm90_pipe_k_loop(tmp_path, swiglu):
    """Per 128-K step: 16 wgmma (4 sub-steps x 2 m64 tiles x 2 k16) in 4 groups, each group waited for only
    when the next is issued (a serialised chain has ``DEPBAR.LE gsb0, 0x0`` after every wgmma); loads are
    cp.async into the ring and shared-memory loads, no spills; measured 3.64 instructions per weight."""
    block_m, block_n, block_k, num_warps, _ = pipe.PIPE_CONFIG
    loops = _inner_loops(_compile_in_subprocess(pipe.PIPE_CONFIG, dict(swiglu=swiglu), tmp_path, kind="pipe"), tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HGMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    assert ops["HGMMA"] == (block_n // 64 // (num_warps // 4)) * block_k // 16
    assert ops["WARPGROUP"] == 2 * block_k // pipe.SUB_K  # one arrive + one DEPBAR (for all but 1) per sub-step
    assert not ops["LDG"] and not ops["LDL"] and not ops["STL"] and not ops["STS"]
    # two CTA barriers per step (the compiler's, after the cp.async wait and before the refill), no memory barrier
    # or proxy fence (an explicit fence.proxy.async became MEMBAR.ALL.CTA + FENCE every step: the peer has none)
    assert ops["BAR"] == 2 and not ops["MEMBAR"] and not ops["FENCE"], ops
    # x: 16-byte chunks of BLOCK_M x 128 bf16; weight words: 16-byte chunks of BLOCK_N x 64 B; scales: 8 B per row
    threads = 32 * num_warps
    assert ops["LDGSTS"] == (block_m * block_k * 2 + block_n * block_k // 2) // 16 // threads + block_n // threads
    assert count / (block_n * block_k // threads) <= 3.64 * 1.05, (count, ops)


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("depth", [2, 3])
def test_sm90_pipe_wait_depth(tmp_path, depth):
    """``wait_depth`` 2 / 3: the K loop leaves that many sub-steps in flight (``DEPBAR.LE gsb0, depth``), with the
    same wgmmas and copies and no spill in the loop (the extra A operands fit in 255 registers)."""
    import re
    import subprocess

    cubin = _compile_in_subprocess(pipe.PIPE_CONFIG, dict(swiglu=True, wait_depth=depth), tmp_path, kind="pipe")
    loops = _inner_loops(cubin, tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HGMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    assert ops["HGMMA"] == 16 and ops["WARPGROUP"] == 8 and ops["LDGSTS"] == 13
    assert not ops["LDL"] and not ops["STL"], ops
    path = tmp_path / "kernel.cubin"
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    levels = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert levels == {"0x0", hex(depth)}, levels  # the final wait, and the chain's


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
def test_sm90_pipe_tail_tile_k_loop(tmp_path):
    """A 96-row tile (64 + 32, PIPE_TAIL_CONFIGS): per 128-K step each decoded A sub-step feeds two wgmma pairs (N 64
    and N 32), so 32 HGMMA and a chain wait of 2 groups; the A registers are shared (no shuffle or shared-memory
    round trip for the second wgmma's operand), no spill in the loop; x copies cover 96 rows."""
    import re
    import subprocess

    config = pipe.PIPE_TAIL_CONFIGS[96]
    cubin = _compile_in_subprocess(config, dict(swiglu=True), tmp_path, kind="pipe")
    k_loops = [(n, ops) for n, ops in _inner_loops(cubin, tmp_path) if ops["HGMMA"]]
    assert len(k_loops) == 1, k_loops
    count, ops = k_loops[0]
    assert ops["HGMMA"] == 32, ops
    assert not ops["LDL"] and not ops["STL"] and not ops["SHFL"] and not ops["STS"] and not ops["LDG"], ops
    threads = 32 * config[3]
    assert ops["LDGSTS"] == (96 * 128 * 2 + 256 * 128 // 2) // 16 // threads + 256 // threads
    assert ops["BAR"] == 2 and not ops["MEMBAR"], ops
    sass = subprocess.run([_cuobjdump(), "-sass", str(tmp_path / "kernel.cubin")], capture_output=True, text=True,
                          check=True).stdout
    assert set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)) == {"0x0", "0x2"}
    # measured 526 SASS per step (4.1 per weight; the 128-row tile: 471, 3.68)
    assert count / (256 * 128 // threads) <= 4.1 * 1.05, (count, ops)


def test_split_tile_rows():
    assert [pipe.split_tile_rows(m) for m in (16, 32, 48, 64, 80, 96, 128, 192)] == [
        (16, 0), (32, 0), (32, 16), (64, 0), (64, 16), (64, 32), (128, 0), (128, 64)]
    for bad in (8, 24, 100, 112, 96.0):
        with pytest.raises(ValueError, match="BLOCK_M"):
            pipe.split_tile_rows(bad)


def test_wait_depth_argument_is_checked():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    for bad in (0, 4, True, 2.0):
        with pytest.raises(ValueError, match="wait_depth"):
            pipe.launch_nvfp4_wgmma_pipe(x, torch.zeros(1, 8, 128, dtype=torch.uint8), None, None,
                                         torch.empty(4, 8, dtype=torch.bfloat16),
                                         expert_offsets=torch.tensor([4], dtype=torch.int32), wait_depth=bad)


def _run(x, w, out_shape, **kwargs):
    out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device=x.device)
    pipe.launch_nvfp4_wgmma_pipe(x, w.data, w.block_scale, w.global_scale, out, **kwargs)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("counts,n,k", [
    ([0, 300, 7, 0, 129], 200, 1024),  # empty experts, tails, N not a multiple of 256
    ([600, 0, 0, 0], 256, 768),  # one expert holds every row; 6 K steps
    ([1, 2, 3, 4], 512, 256),  # two K steps (fewer than the ring)
    ([128, 256, 384], 768, 512),  # exact tiles
])
def test_cuda_pipe_grouped_row_index(counts, n, k):
    device = torch.device("cuda")
    e = len(counts)
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 5  # padding rows
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    out = _run(x, w, (t, n), expert_offsets=offsets_of(counts, device), row_index=row_index)
    real = sum(counts)
    assert (out[real:] == 0).all()
    # bf16 output rounding dominates (~2e-3); a wrong K order, scale or tile gives >= 1e-1
    assert rel_err(out[:real], grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)[:real]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [None, 7.0])
def test_cuda_pipe_swiglu_v4_flash_shape_skewed(limit):
    """V4-Flash gate_up (H = 4096, I = 2048) of 16 experts, Zipf-like rows (one hot expert), SwiGLU."""
    device = torch.device("cuda")
    counts = SKEWED_COUNTS_16
    x, w, i = v4_flash_gate_up_case(counts, device)
    t = sum(counts)
    out = _run(x, w, (t, i), expert_offsets=offsets_of(counts, device), swiglu=True, swiglu_limit=limit)
    ref = swiglu_reference(grouped_f32(x, w, offsets_of(counts, "cpu")), limit)
    assert rel_err(out, ref) < 4e-3


@pytest.mark.cuda
def test_cuda_pipe_exact_decode_and_guard():
    device = torch.device("cuda")
    # every code through an identity: exact decode in the MMA K order
    assert_exact_decode(lambda x, w, out, offsets: pipe.launch_nvfp4_wgmma_pipe(
        x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), 256, 512, device)
    # a row_index outside [0, S) is flagged and reads no memory outside x
    from megamoe.ops import errors

    w2 = random_weight((2, 256, 256), device, scale_shape=(2, 1, 1))
    x = torch.randn(40, 256, device=device).bfloat16()
    row_index = torch.arange(40, device=device, dtype=torch.int32)
    row_index[3] = 1 << 20
    word = torch.zeros(1, dtype=torch.int32, device=device)
    out = _run(x, w2, (40, 256), expert_offsets=offsets_of([10, 30], device), row_index=row_index, error_word=word)
    assert int(word.item()) != 0 or not errors.DEVICE_GUARD
    # the flagged row reads zero activations (the reference's drop rule), not row 0 (it did until 2026-11-26);
    # the other rows are untouched
    assert (out[3] == 0).all()
    x_zero_row = torch.cat([x, torch.zeros_like(x[:1])])
    ref = grouped_f32(x_zero_row, w2, offsets_of([10, 30], "cpu"), torch.where(row_index == 1 << 20, 40, row_index))
    assert rel_err(out, ref) < 4e-3
    with pytest.raises(ValueError, match="expert_offsets"):
        pipe.launch_nvfp4_wgmma_pipe(x, w2.data[0], w2.block_scale[0], w2.global_scale, x, expert_offsets=None)
    w3 = random_weight((2, 256, 384), device, scale_shape=(2, 1, 1))
    with pytest.raises(ValueError, match="multiple of 256"):
        _run(torch.randn(8, 384, device=device).bfloat16(), w3, (8, 256), expert_offsets=offsets_of([4, 4], device))


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [2, 3])
def test_cuda_pipe_wait_depth_same_bits(depth):
    """``wait_depth`` 2 / 3 issue the same wgmmas in the same order: the same bits as the default (H100: also seen in
    benchmarks/results/gpu_check_v22, V4-Flash shapes), here with SwiGLU + row gather and without."""
    device = torch.device("cuda")
    counts = [0, 300, 7, 0, 129]
    w = random_weight((len(counts), 512, 1024), device, scale_shape=(len(counts), 1, 1))
    t = sum(counts) + 5
    x = torch.randn(t, 1024, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    for kwargs, width in ((dict(row_index=row_index, swiglu=True, swiglu_limit=7.0), 256), (dict(), 512)):
        one = _run(x, w, (t, width), expert_offsets=offsets, **kwargs)
        deep = _run(x, w, (t, width), expert_offsets=offsets, wait_depth=depth, **kwargs)
        assert torch.equal(deep, one)


@pytest.mark.cuda
@pytest.mark.parametrize("tile_list", [False, True])
def test_cuda_pipe_sync_free_and_graph(tile_list):
    """Sync-free, and a captured graph follows a routing rewritten in place bit for bit with eager; with
    ``tile_list`` the launch's tile lists are built on the device at every replay."""
    device = torch.device("cuda")
    e, n, k, t = 16, 512, 512, 3000
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t, k, device=device).bfloat16()
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)

    def launch():
        return pipe.launch_nvfp4_wgmma_pipe(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                            tile_list=tile_list)

    launch()
    check_sync_free_and_graph(launch, x, offsets, t)
    assert rel_err(out, grouped_f32(x, w, offsets)) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("rows_per_expert", [100, 400])
def test_cuda_pipe_route(monkeypatch, rows_per_expert):
    """Through nvfp4_grouped_mm with PIPE_ROUTE on: the banded route's top band (100 rows) and the > 256-row
    route (400 rows) run the pipelined kernel; same result bound, padding rows zero."""
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe
    from megamoe.ops import gemm as ops_gemm

    calls = []
    real_launch = nvfp4_wgmma_pipe.launch_nvfp4_wgmma_pipe

    def spy(*args, **kwargs):
        calls.append(kwargs.get("row_lo", 0))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    monkeypatch.setattr(nvfp4_wgmma_pipe, "launch_nvfp4_wgmma_pipe", spy)
    device = torch.device("cuda")
    e, n, k = 8, 512, 1024
    counts = [rows_per_expert] * (e - 2) + [3, 0]
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts)
    x = torch.randn(t, k, device=device).bfloat16()
    out = ops_gemm.nvfp4_grouped_mm(x, w, offsets_of(counts, device))
    assert calls, "the pipelined kernel did not run"
    assert rel_err(out, grouped_f32(x, w, offsets_of(counts, "cpu"))) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("block_m,small", [(16, False), (32, False), (64, False), (16, True), (32, True), (48, False),
                                           (96, False)])
def test_cuda_pipe_band_configs_compute_only_their_band(block_m, small):
    """A band launch (row_lo < rows <= row_hi, the band configs of PIPE_BAND_CONFIGS / PIPE_TAIL_CONFIGS, and the
    48-row tail tile that is not a band) writes
    exactly its experts' rows (others keep their NaN), correct to the float32 bound; own_pad zeroes the padding
    rows."""
    device = torch.device("cuda")
    counts = [0, 5, 16, 17, 32, 33, 40, 48, 49, 64, 65, 80, 96, 97, 200]
    e, n, k = len(counts), 512, 1024
    lo, hi = {48: 32, 96: 64}.get(block_m, block_m // 2 if block_m > 16 else 0), block_m
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 7
    x = torch.randn(t, k, device=device).bfloat16()
    offsets = offsets_of(counts, device)
    configs = {**pipe.PIPE_BAND_CONFIGS, **pipe.PIPE_TAIL_CONFIGS, 48: pipe.PIPE_BM48_CONFIG}
    config = pipe.PIPE_SMALL_CONFIGS[block_m] if small else configs.get(block_m, pipe.PIPE_BM16_CONFIG)
    out = _run(x, w, (t, n), expert_offsets=offsets, config=config, row_lo=lo, row_hi=hi)
    ref = grouped_f32(x, w, offsets_of(counts, "cpu"))
    start = 0
    for c in counts:
        rows = out[start:start + c]
        if lo < c <= hi:
            assert rel_err(rows, ref[start:start + c]) < 4e-3, c
        else:
            assert torch.isnan(rows.float()).all(), c
        start += c
    assert (out[start:] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("config", [(16, 128, 128, 4, 8, 2), (32, 128, 128, 4, 6, 2), (96, 256, 128, 8, 4), None])
def test_cuda_pipe_interleaved_weights_same_bits(config):
    """Weights and scales with 4 rows interleaved per K step (NVFP4Tensor.interleave_rows), read with
    weight_interleave=4: the same bits as the row-major layout, SwiGLU and gather included, N not a multiple of the
    tile (rows past N are clamped in both layouts); a layout read as the other one fails."""
    device = torch.device("cuda")
    counts = [0, 1, 9, 16, 40, 100, 3]
    e, n, k = len(counts), 328, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    w4 = w.interleave_rows(4)
    data_il, scale_il = w4.data, w4.block_scale
    t = sum(counts) + 2
    x = torch.randn(t, k, device=device).bfloat16()
    kwargs = dict(expert_offsets=offsets_of(counts, device), row_index=torch.randperm(t, device=device).to(torch.int32),
                  swiglu=True, swiglu_limit=7.0, config=config)
    out = torch.full((t, n // 2), float("nan"), dtype=torch.bfloat16, device=device)
    plain = _run(x, w, (t, n // 2), **kwargs)
    pipe.launch_nvfp4_wgmma_pipe(x, data_il, scale_il, w.global_scale, out, weight_interleave=4, **kwargs)
    assert torch.equal(out, plain)
    pipe.launch_nvfp4_wgmma_pipe(x, data_il, scale_il, w.global_scale, out, **kwargs)  # read as row-major
    assert not torch.equal(out, plain)


def test_weight_interleave_argument_is_checked():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    data = torch.zeros(2, 6, 128, dtype=torch.uint8)
    scale = torch.zeros(2, 6, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for bad, shape_data in ((2, data), (4, data), (8, torch.zeros(2, 8, 128, dtype=torch.uint8))):
        with pytest.raises(ValueError, match="weight_interleave"):
            pipe.launch_nvfp4_wgmma_pipe(x, shape_data, scale, torch.ones(()), torch.empty(4, 6), weight_interleave=bad,
                                         expert_offsets=torch.tensor([2, 4], dtype=torch.int32))


@pytest.mark.cuda
def test_cuda_pipe_ring_depth_and_register_cap_same_bits():
    """The 16-row small band at 6 / 8 ring stages, and three programs per SM under a register cap (the config's
    7th entry, ptxas maxnreg 168): the same MMAs in the same order, so the same bits, with the gather and SwiGLU and
    a ring deeper than the K loop (K = 512: 4 steps)."""
    device = torch.device("cuda")
    counts = [0, 1, 9, 16, 3, 12]
    for k in (512, 2048):
        e, n = len(counts), 384
        w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
        t = sum(counts) + 2
        x = torch.randn(t, k, device=device).bfloat16()
        row_index = torch.randperm(t, device=device).to(torch.int32)
        offsets = offsets_of(counts, device)
        kwargs = dict(expert_offsets=offsets, row_index=row_index, swiglu=True, swiglu_limit=7.0)
        outs = [_run(x, w, (t, n // 2), config=config, **kwargs)
                for config in ((16, 128, 128, 4, 6, 2), (16, 128, 128, 4, 8, 2), (16, 128, 128, 4, 5, 3, 168))]
        assert not torch.isnan(outs[0][:sum(counts)].float()).any()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.cuda
@pytest.mark.parametrize("tile_m", [48, 96])
def test_cuda_pipe_tail_tile_same_bits_as_power_of_two_tile(tile_m):
    """A 48 / 96-row tile (head + tail wgmma on the same decoded A) issues, per output element, the same bf16
    products in the same k16 order as the 64 / 128-row tile: the same bits, with the row gather and SwiGLU (a
    skipped or shifted tail row, or a tail reading the head's x, fails it)."""
    device = torch.device("cuda")
    counts = [0, 1, 17, 33, 47, 48, 65, 95, 96, 130, 200]
    e, n, k = len(counts), 512, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    power = pipe.PIPE_BAND_CONFIGS[64] if tile_m == 48 else pipe.PIPE_CONFIG
    for kwargs, width in ((dict(row_index=row_index, swiglu=True, swiglu_limit=7.0), n // 2), (dict(), n)):
        config = pipe.PIPE_BM48_CONFIG if tile_m == 48 else pipe.PIPE_TAIL_CONFIGS[tile_m]
        tail = _run(x, w, (t, width), expert_offsets=offsets, config=config, **kwargs)
        full = _run(x, w, (t, width), expert_offsets=offsets, config=power, **kwargs)
        assert torch.equal(tail, full)


# ---- the tile lists: one persistent launch per list instead of one per band (NOTES_gemm.md v24) ----

def _list_routings(rng):
    """(counts, T) cases around the tile kinds' row edges: empty experts, one expert holding every row, padding."""
    edges = [0, 1, 32, 33, 64, 65, 96, 97, 128, 129, 192, 193, 256, 257, 1000]
    yield edges, sum(edges) + 5
    yield [0, 0, 0], 7
    yield [900, 0, 0, 0], 900
    yield [0] * 7 + [300], 301
    for _ in range(6):
        counts = [rng.choice([0, rng.randrange(1, 40), rng.randrange(30, 200), rng.randrange(150, 700)])
                  for _ in range(rng.randrange(1, 20))]
        yield counts, sum(counts) + rng.randrange(0, 200)


@pytest.mark.parametrize("row_lo,own_pad", [(32, True), (0, True), (100, False)])
def test_tile_list_reference_covers_rows_once(row_lo, own_pad):
    """Lists A + B take every row of the experts with more than ``row_lo`` rows exactly once (and the padding rows
    with ``own_pad``), in tiles of their kind's height inside their expert; list A holds 128- then 64-row tiles then
    padding, list B the 96-row tiles; both within the host capacity."""
    import random

    heights = {0: 128, 1: 96, 2: 64}
    for counts, t in _list_routings(random.Random(row_lo)):
        offsets = list(torch.tensor(counts).cumsum(0).tolist())
        list_a, list_b = pipe.tile_list_reference(offsets, t, row_lo, own_pad)
        cap = pipe.tile_list_capacity(t, len(counts), row_lo, own_pad)
        assert len(list_a) <= cap and len(list_b) <= cap
        assert [k for *_, k in list_b] == [1] * len(list_b)
        kinds_a = [k for *_, k in list_a]
        assert kinds_a == sorted(kinds_a, key=lambda k: (k != 0, k)) or kinds_a[-1] == 0  # 128, 64, then padding
        covered = [0] * t
        starts = [0] + offsets[:-1]
        for expert, first, end, kind in list_a + list_b:
            lo = starts[expert] if expert < len(counts) else offsets[-1]
            hi = offsets[expert] if expert < len(counts) else t
            assert lo <= first < end == hi
            for r in range(first, min(first + heights[kind], end)):
                covered[r] += 1
        want = [0] * t
        for e, c in enumerate(counts):
            if c > row_lo:
                want[starts[e]:starts[e] + c] = [1] * c
        if own_pad:
            want[offsets[-1]:] = [1] * (t - offsets[-1])
        assert covered == want, counts


def test_tile_list_kernel_matches_reference(device):
    """The device-built lists (the interpreter on CPU) equal the Python reference, counts included; offsets that
    decrease (against the contract) write no more than the capacity."""
    import random

    for counts, t in _list_routings(random.Random(1)):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        for row_lo, own_pad in ((32, True), (0, False)):
            list_a, list_b = pipe.launch_tile_lists(offsets.to(device), t, len(counts), row_lo, own_pad)
            ref_a, ref_b = pipe.tile_list_reference(offsets.tolist(), t, row_lo, own_pad)
            for got, ref in ((list_a.cpu(), ref_a), (list_b.cpu(), ref_b)):
                assert int(got[0]) == len(ref) and int(got[1]) == 0  # count, the kernel's zeroed work counter
                assert got[4:4 + 4 * len(ref)].view(-1, 4).tolist() == [list(item) for item in ref], counts
    bad = torch.tensor([500, 0, 500, 0, 500], dtype=torch.int32, device=device)  # decreasing: 1500 rows claimed
    cap = pipe.tile_list_capacity(500, 5, 32, True)
    list_a, list_b = pipe.launch_tile_lists(bad, 500, 5, 32, True)
    assert list_a.numel() == 4 + 4 * cap and int(list_a[0]) <= cap and int(list_b[0]) <= cap


def test_tile_list_argument_rules():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    for bad in (dict(config=pipe.PIPE_CONFIG), dict(row_hi=64), dict(wait_depth=2)):
        with pytest.raises(ValueError, match="tile_list"):
            pipe.launch_nvfp4_wgmma_pipe(x, torch.zeros(1, 8, 128, dtype=torch.uint8), None, None,
                                         torch.empty(4, 8, dtype=torch.bfloat16), tile_list=True,
                                         expert_offsets=torch.tensor([4], dtype=torch.int32), **bad)


@gluon_only
@pytest.mark.slow
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("kinds", [5, 2])
def test_sm90_tile_list_k_loops(tmp_path, kinds):
    """The list kernels' K loops are the band kernels' (list A: the 128- and 64-row loops, 16 HGMMA per step; list
    B: the 96-row loop, 32 HGMMA): two CTA barriers per step, at most one spilled register per step (list A's
    128-row SwiGLU loop since the dynamic work counter: one LDL + one STL in ~468 instructions), and ptxas did not
    serialise the wgmmas (the three kinds in one kernel did: C7512). Built as launched (OVERLAP 1 / 2)."""
    import re
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "kernel.cubin"
    code = ("import sys; from megamoe.kernels.gemm.nvfp4_wgmma_pipe import compile_list_for_sm90; "
            f"c = compile_list_for_sm90({kinds}, swiglu=True, overlap={1 if kinds == 5 else 2}); "
            "open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True, timeout=600)
    k_loops = [ops for _, ops in _inner_loops(path.read_bytes(), tmp_path) if ops["HGMMA"]]
    assert [ops["HGMMA"] for ops in k_loops] == ([16, 16] if kinds == 5 else [32]), k_loops
    for ops in k_loops:
        assert ops["LDL"] <= 1 and ops["STL"] <= 1 and ops["BAR"] == 2, ops
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    levels = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert levels == ({"0x0", "0x1"} if kinds == 5 else {"0x0", "0x2"}), levels


@pytest.mark.cuda
@pytest.mark.parametrize("interleave", [1, 4])
def test_cuda_tile_list_same_bits_as_bands(monkeypatch, interleave):
    """nvfp4_grouped_mm with PIPE_LIST (the bands above 32 rows as two tile-list launches) gives the bits of the band
    launches, with the row gather and SwiGLU and without, on experts at every tile kind's row edges, empty experts,
    padding rows and a hot expert; interleaved weights too."""
    from megamoe.ops import gemm as ops_gemm

    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    device = torch.device("cuda")
    counts = [0, 1, 31, 32, 33, 64, 65, 96, 97, 128, 129, 192, 193, 900, 0, 40]
    e, n, k = len(counts), 512, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    if interleave > 1:
        w = w.interleave_rows(interleave)
    t = sum(counts) + 9
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    offsets = offsets_of(counts, device)
    for kwargs in (dict(row_index=row_index, activation="swiglu", swiglu_limit=7.0), dict()):
        monkeypatch.setattr(ops_gemm, "PIPE_LIST", False)
        bands = ops_gemm.nvfp4_grouped_mm(x, w, offsets, **kwargs)
        monkeypatch.setattr(ops_gemm, "PIPE_LIST", True)
        plan = ops_gemm.plan_row_bands(t, e, k)
        assert any(band.get("tile_list") for _, band in plan), plan
        listed = ops_gemm.nvfp4_grouped_mm(x, w, offsets, **kwargs)
        assert torch.equal(listed, bands)
    assert rel_err(listed, grouped_f32(x, w, offsets_of(counts, "cpu"))) < 4e-3
