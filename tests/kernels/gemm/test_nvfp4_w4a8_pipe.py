"""The pipelined W4A8 grouped GEMM (w4a8 v2, ``megamoe/kernels/gemm/nvfp4_w4a8_pipe.py``, NOTES_gemm.md "w4a8 v2").

CPU: the FP8 MMA K order (its permutation from the wgmma k32 fragment map, and the quantizer writing it, bit for bit,
through the interpreter); the offline sm_90 builds' K loops (4 FP8 wgmma per step in an async chain that ptxas did
not serialise, no spills, no A operand register reused while its wgmma may read it). CUDA: against
``megamoe/reference/w4a8.py`` on skewed routings (empty experts, one expert holding every row, rows that are not a
multiple of the tile, padding rows, N not a multiple of the tile), the fused gather + SwiGLU, non-finite rows and
scales, the row_index guard; the route of ``nvfp4_grouped_mm`` with its row bands (equal to one 128-row launch) and of
``nvfp4_linear`` (one expert); 4-row interleaved weights (the row-major bits); sync-free and graph replay == eager.
CPU: the band spec, the band plan's coverage of every expert row count, the dense config.
"""
import pytest
import torch

from gemm_helpers import (SKEWED_COUNTS_16, check_sync_free_and_graph, offsets_of, random_codes_weight, random_weight,
                          sync_free_graph)
from megamoe.format.mma_order import fp8_mma_k_permutation
from megamoe.kernels.gemm import nvfp4_w4a8_pipe as w4a8_pipe
from megamoe.ops.gemm import interleave_gate_up, nvfp4_grouped_mm, nvfp4_linear
from megamoe.reference import w4a8 as ref_w4a8
from test_nvfp4_gluon import _cuobjdump, _inner_loops, gluon_only
from test_nvfp4_w4a8 import _assert_close_to_reference, _quant

cuda_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                               reason="needs an sm_90 GPU")


def test_fp8_mma_k_order_is_the_fragment_map():
    """Position kappa of a 128-K step holds memory element m: sub-step i = kappa // 32 is one k32 wgmma; in its A
    fragment, quad lane q holds K positions 4q..4q+3 (elements 0-3 of its word i) and 16 + 4q.. (elements 4-7);
    lane q's word i is memory 32q + 8i .. 32q + 8i + 7."""
    perm = fp8_mma_k_permutation()
    assert sorted(perm.tolist()) == list(range(128))
    for kappa in range(128):
        i, pos = divmod(kappa, 32)
        g, rest = divmod(pos, 16)
        q, c = divmod(rest, 4)
        assert int(perm[kappa]) == 32 * q + 8 * i + 4 * g + c


@pytest.mark.parametrize("k", [128, 384])
def test_quantizer_writes_the_fp8_mma_k_order(device, k):
    """``mma_order=True``: the same codes and scales as the reference, columns permuted within each 128-K group."""
    x = (torch.randn(13, k) * torch.logspace(-3, 3, 13)[:, None]).bfloat16().to(device)
    x[2, 5] = float("nan")
    codes, scales = _quant(x, mma_order=True)
    rc, rs = ref_w4a8.quantize_activations_fp8(x.cpu())
    perm = fp8_mma_k_permutation()
    expected = rc.view(torch.uint8).reshape(13, k // 128, 128)[:, :, perm].reshape(13, k)
    assert torch.equal(codes.cpu().view(torch.uint8), expected)
    assert torch.equal(torch.isnan(scales.cpu()), torch.isnan(rs))
    assert torch.equal(scales.cpu().nan_to_num(), rs.nan_to_num())


def _a_operand_hazards(sass: str) -> list:
    """QGMMAs whose register A operand (4 consecutive registers) is written before a ``WARPGROUP.DEPBAR.LE gsb0, N``
    that guarantees the QGMMA is done (N <= the QGMMAs issued after it), following loop back edges once. The hardware
    reads A asynchronously, and with FP8 operands the kernel cannot list A in ``warpgroup_mma_wait``'s deps (Triton
    3.6 aborts: "Unexpected bitwidth in WGMMAWaitGroupOp: 8"), so nothing but this check keeps ptxas from reusing
    them: a variant that decoded a whole step ahead was reused that way and computed garbage (gpu_check_v27 f)."""
    import re

    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    addr = [a for a, _ in code]
    body = [t for _, t in code]
    index = {a: i for i, a in enumerate(addr)}
    back = {}
    for i, t in enumerate(body):
        m = re.search(r"BRA (0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < addr[i]:
            back[i] = index[int(m.group(1), 16)]
    found = []
    for i, t in enumerate(body):
        m = re.search(r"QGMMA\S* R\d+, R(\d+)", t)
        if not m:
            continue
        regs = {f"R{int(m.group(1)) + j}" for j in range(4)}
        issued, j, wrapped = 0, i + 1, False
        while j < len(body):
            u = body[j]
            issued += "QGMMA" in u
            wait = re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", u)
            if wait and int(wait.group(1), 16) <= issued:
                break
            ops = re.sub(r"^@!?U?P\w+\s+", "", u).replace(",", " ").split()
            if len(ops) > 1 and not ops[0].startswith(("QGMMA", "ST", "BRA", "BAR", "WARPGROUP", "DEPBAR", "LDGSTS",
                                                       "BSYNC", "BSSY", "EXIT", "RET")) and ops[1] in regs:
                found.append((t, u))
                break
            if j in back and not wrapped:
                j, wrapped = back[j], True
                continue
            j += 1
    return found


@gluon_only
@pytest.mark.slow
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("block_m,swiglu,row_index", [(128, True, True), (128, False, True), (128, False, False),
                                                     (64, True, True), (64, False, False), (96, True, True),
                                                     (96, False, False)])
def test_sm90_w4a8_pipe_k_loop(tmp_path, block_m, swiglu, row_index):
    """Every build the op launches (128-row tiles; 64- and 96-row tiles for the bands): per 128-K step 4 FP8
    wgmma (``QGMMA.64xBLOCK_Mx32``: one m64 tile per warpgroup, 4 k32 sub-steps) in an async chain
    (``DEPBAR.LE gsb0, 0x1``; the step's last one before the promotion), the ring by cp.async, no spills in the loop,
    no A operand register written while its QGMMA may still read it (offline, Triton 3.6's ptxas: 373-377
    instructions per step at BLOCK_M 128, 387 at 96, 334 at 64)."""
    import re
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel.cubin"
    code = ("import sys; from megamoe.kernels.gemm.nvfp4_w4a8_pipe import W4A8_PIPE_CONFIG, "
            "compile_w4a8_pipe_for_sm90; "
            f"c = compile_w4a8_pipe_for_sm90(({block_m},) + W4A8_PIPE_CONFIG[1:], swiglu={swiglu!r}, "
            f"row_index={row_index!r}); "
            "open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=600)
    loops = _inner_loops(out.read_bytes(), tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["QGMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    tail = block_m == 96  # a 64-row head and a 32-row tail: two wgmmas per sub-step on the same A
    assert ops["QGMMA"] == (8 if tail else 4) and ops["DEPBAR"] == 1  # DEPBAR: the cp.async wait
    assert not ops["LDG"] and not ops["LDL"] and not ops["STL"] and not ops["STS"], ops
    assert ops["FFMA"] == block_m // 2  # the promotion: one per accumulator element
    assert count / 64 <= {128: 5.9, 96: 6.05, 64: 5.25}[block_m] * 1.05, (count, ops)
    sass = subprocess.run([_cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    assert set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)) == {"0x0", "0x2" if tail else "0x1"}
    assert not _a_operand_hazards(sass)


@cuda_sm90
@pytest.mark.cuda
@pytest.mark.parametrize("counts,n", [
    (SKEWED_COUNTS_16, 256),  # skew: a hot expert, empty experts, tails of every size
    ([0, 0, 300, 0], 192),  # one expert holds every row; N not a multiple of the 128-row tile
    ([1, 2, 3, 0, 127, 129], 128),  # rows just below / above the tile
])
def test_cuda_kernel_matches_reference(counts, n):
    e, k = len(counts), 512
    w = random_weight((e, n, k), "cuda", scale_shape=(e, n, 1))
    t = sum(counts)
    x = (torch.randn(t + 5, k) * torch.logspace(-2, 2, t + 5)[:, None]).bfloat16().cuda()  # 5 padding rows
    offsets = offsets_of(counts, "cuda")
    xq, xs = _quant(x, mma_order=True)
    out = torch.full((t + 5, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets)
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu())
    _assert_close_to_reference(out[:t], ref[:t])
    assert torch.equal(out[t:].cpu(), torch.zeros(5, n, dtype=torch.bfloat16))


@cuda_sm90
@pytest.mark.cuda
def test_cuda_gather_swiglu_guard_and_nonfinite():
    """Fused row_index gather + SwiGLU + clamp; an out-of-range index reads zeros and sets the guard flag; a NaN
    activation row and a NaN block scale make their outputs NaN, the others keep their values."""
    from megamoe.ops import errors

    e, n, k, s = 5, 256, 1024, 40
    w = interleave_gate_up(random_weight((e, n, k), "cuda", scale_shape=(e, n, 1)))
    w.block_scale.view(torch.uint8)[2, 7, 3] = 0x7F  # NaN scale: row 7 of expert 2 (block 3: K 48..63)
    counts = [60, 0, 33, 1, 90]
    t = sum(counts)
    x = (torch.randn(s, k) * 2).bfloat16().cuda()
    x[11, 100] = float("nan")
    row_index = torch.randint(0, s, (t,), dtype=torch.int32, device="cuda")
    row_index[5] = s + 3  # out of range
    offsets = offsets_of(counts, "cuda")
    dev = torch.device("cuda")
    errors.clear_errors(dev)
    xq, xs = _quant(x, mma_order=True)
    out = torch.empty(t, n // 2, dtype=torch.bfloat16, device="cuda")
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                     row_index=row_index, swiglu=True, swiglu_limit=7.0)
    assert errors.decode(errors.peek_errors(dev)) == [("nvfp4_grouped_mm", "row_index")]
    errors.clear_errors(dev)
    safe = torch.where(row_index < s, row_index, -1)
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=safe.cpu(), activation="swiglu",
                                   swiglu_limit=7.0)
    pre = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), row_index=safe.cpu())
    # SwiGLU maps many outputs near 0 (a small gate): 1.2% of them were more than 2**-7 relative apart on the H100
    # (gpu_check_v27 b), all within the absolute bound
    _assert_close_to_reference(out, ref, magnitude=float(pre.float().nan_to_num().abs().max()) * (1.1 * 7.0 + 0.28),
                               far_fraction=0.03)
    assert torch.equal(out[5].cpu(), torch.zeros(n // 2, dtype=torch.bfloat16))
    nan_rows = (row_index == 11).nonzero().flatten().tolist()
    assert all(torch.isnan(out[r]).all() for r in nan_rows)
    assert torch.isnan(out[60:93, 3]).all()  # expert 2's rows: SwiGLU pair 3 = gate/up rows 6, 7


@cuda_sm90
@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["64", "64,96", "64,96,128,192:96"])
def test_cuda_op_bands_match_reference_and_one_launch(spec, monkeypatch):
    """Through ``nvfp4_grouped_mm``: each band's experts run its launch (default "64,96,128,192:96": <= 64 rows in
    64-row tiles, 65-96 in 96-row (64 + 32) tiles, 97-128 in one 128-row tile, 129-192 in two 96-row tiles), the
    rest 128-row tiles; the result equals one 128-row launch over every expert bit for bit and the reference within
    the bound."""
    monkeypatch.setattr(w4a8_pipe, "W4A8_BAND_CONFIGS", w4a8_pipe.band_configs(spec))
    counts = SKEWED_COUNTS_16 + [65, 80, 96, 97, 128, 129, 150, 192, 193]
    e, n, k = len(counts), 256, 1024
    w = random_weight((e, n, k), "cuda", scale_shape=(e, n, 1))
    t = sum(counts)
    x = torch.randn(t + 3, k).bfloat16().cuda()
    offsets = offsets_of(counts, "cuda")
    out = nvfp4_grouped_mm(x, w, offsets, mode="w4a8")
    xq, xs = _quant(x, mma_order=True)
    one = torch.empty_like(out)
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, one, expert_offsets=offsets)
    assert torch.equal(out, one)
    ref = ref_w4a8.w4a8_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu())
    _assert_close_to_reference(out, ref)


@cuda_sm90
@pytest.mark.cuda
def test_cuda_op_routes_here_and_graph_replay_equals_eager():
    """``nvfp4_grouped_mm(mode="w4a8")`` runs this kernel (the same bits as a direct launch), without host syncs,
    and a graph replay after the routing and the activations changed in place equals an eager launch."""
    e, n, k, tokens = 8, 512, 2048, 1024
    w = random_codes_weight((e, n, k), "cuda", scale_shape=(e, 1, 1))
    counts = torch.bincount(torch.randint(0, e, (tokens,)), minlength=e)
    offsets = offsets_of(counts.tolist(), "cuda")
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    assert w4a8_pipe.W4A8_PIPE_ROUTE and w4a8_pipe.w4a8_pipe_supported(x, w.data)
    via_op = nvfp4_grouped_mm(x, w, offsets, mode="w4a8").clone()
    xq, xs = _quant(x, mma_order=True)
    direct = w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, out,
                                              expert_offsets=offsets)
    assert torch.equal(via_op, direct)
    check_sync_free_and_graph(lambda: nvfp4_grouped_mm(x, w, offsets, mode="w4a8", out=out), x, offsets, tokens)


@cuda_sm90
@pytest.mark.cuda
@pytest.mark.parametrize("m", [48, 64, 65, 96, 97, 300])  # each band tile, and rows past a tile
def test_cuda_dense_linear_routes_here(m):
    """``nvfp4_linear(mode="w4a8")`` runs this kernel as one expert of M rows (the smallest band tile holding them):
    the same bits as that grouped launch, the reference within its bound, with a bias; sync-free, and a graph replay
    after x changed in place equals an eager call."""
    from megamoe.reference.w4a8 import w4a8_linear

    n, k = 320, 1024  # N not a multiple of the 128-row weight tile
    w = random_weight((n, k), "cuda", per_row_scale=True)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]).bfloat16().cuda()
    bias = torch.randn(n).bfloat16().cuda()
    out = nvfp4_linear(x, w, bias, mode="w4a8")
    xq, xs = _quant(x, mma_order=True)
    one = torch.empty_like(out)
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data[None], w.block_scale[None], w.global_scale, one,
                                     expert_offsets=torch.tensor([m], dtype=torch.int32, device="cuda"), bias=bias,
                                     config=w4a8_pipe.dense_config(m))
    assert torch.equal(out, one)
    _assert_close_to_reference(out, w4a8_linear(x.cpu(), w.to("cpu"), bias.cpu()))
    buf = torch.empty_like(out)
    graph, _ = sync_free_graph(lambda: nvfp4_linear(x, w, bias, mode="w4a8", out=buf))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, nvfp4_linear(x, w, bias, mode="w4a8"))


def test_band_configs_parse_edges_and_tile_rows():
    rest = w4a8_pipe.W4A8_PIPE_CONFIG[1:]
    assert w4a8_pipe.band_configs("64,96,128,192:96") == {64: (64,) + rest, 96: (96,) + rest, 128: (128,) + rest,
                                                          192: (96,) + rest}
    assert w4a8_pipe.band_configs("96, 64") == {64: (64,) + rest, 96: (96,) + rest}
    assert w4a8_pipe.band_configs("0") == {} and w4a8_pipe.band_configs("") == {}


@pytest.mark.parametrize("spec", ["64,96,128,192:96", "64", ""])
def test_band_plan_covers_every_row_count_once(spec, monkeypatch):
    """Every possible expert row count (1..T) falls in exactly one launch's (row_lo, row_hi], the last launch writes
    the padding rows, bands no expert can reach are skipped, and one expert is one launch in its smallest tile."""
    monkeypatch.setattr(w4a8_pipe, "W4A8_BAND_CONFIGS", w4a8_pipe.band_configs(spec))
    for num_rows in (1, 50, 64, 65, 100, 192, 193, 24576):
        plan = w4a8_pipe.band_plan(num_rows, 256)
        assert [own_pad for *_, own_pad in plan] == [False] * (len(plan) - 1) + [True]
        for rows in range(1, min(num_rows, 300) + 1):
            hits = [p for p in plan if p[1] < rows and (p[2] is None or rows <= p[2])]
            assert len(hits) == 1, (num_rows, rows, plan)
        assert all(lo < num_rows for _, lo, _, _ in plan[:-1])
    assert w4a8_pipe.band_plan(300, 1) == [(w4a8_pipe.dense_config(300), 0, None, True)]


def test_dense_config_is_the_smallest_band_tile():
    edges = sorted(w4a8_pipe.W4A8_BAND_CONFIGS)
    for m in (1, 48, 64, 65, 96, 97, 128, 4096):
        config = w4a8_pipe.dense_config(m)
        fits = [e for e in edges if m <= e]
        assert config == (w4a8_pipe.W4A8_BAND_CONFIGS[fits[0]] if fits else w4a8_pipe.W4A8_PIPE_CONFIG)


@cuda_sm90
@pytest.mark.cuda
@pytest.mark.parametrize("block_m", [128, 96, 64])
def test_cuda_interleaved_weights_same_bits(block_m):
    """4-row interleaved weights (``NVFP4Tensor.interleave_rows(4)``, ``weight_interleave=4``) give the row-major
    launch's bits with the gather + SwiGLU, on every tile height; read as row-major they do not; through the op the
    bands read them too."""
    counts = SKEWED_COUNTS_16 + [65, 96, 97, 150]
    e, n, k, s = len(counts), 256, 1024, 500
    w = interleave_gate_up(random_weight((e, n, k), "cuda", scale_shape=(e, n, 1)))
    w4 = w.interleave_rows(4)
    t = sum(counts)
    x = torch.randn(s, k).bfloat16().cuda()
    row_index = torch.randint(0, s, (t + 2,), dtype=torch.int32, device="cuda")
    offsets = offsets_of(counts, "cuda")
    xq, xs = _quant(x, mma_order=True)
    kw = dict(expert_offsets=offsets, row_index=row_index, swiglu=True, swiglu_limit=7.0,
              config=(block_m,) + w4a8_pipe.W4A8_PIPE_CONFIG[1:])
    plain = torch.empty(t + 2, n // 2, dtype=torch.bfloat16, device="cuda")
    inter = torch.empty_like(plain)
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w.data, w.block_scale, w.global_scale, plain, **kw)
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w4.data, w4.block_scale, w4.global_scale, inter, weight_interleave=4,
                                     **kw)
    assert torch.equal(inter, plain)
    w4a8_pipe.launch_nvfp4_w4a8_pipe(xq, xs, w4.data, w4.block_scale, w4.global_scale, inter, **kw)  # as row-major
    assert not torch.equal(inter, plain)
    op_kw = dict(row_index=row_index, activation="swiglu", swiglu_limit=7.0, mode="w4a8")
    assert torch.equal(nvfp4_grouped_mm(x, w4, offsets, **op_kw), nvfp4_grouped_mm(x, w, offsets, **op_kw))


def test_interleaved_weights_run_w4a16_and_w4a8_only(device):
    w = random_weight((2, 8, 256), device).interleave_rows(4)
    x = torch.randn(4, 256).bfloat16().to(device)
    with pytest.raises(ValueError, match="row_interleave"):
        nvfp4_grouped_mm(x, w, offsets_of([2, 4], device), mode="w4a4")
