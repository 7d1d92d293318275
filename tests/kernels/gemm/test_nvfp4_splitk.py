"""Dense split-K NVFP4 GEMM (megamoe/kernels/gemm/nvfp4_splitk.py) against float32 math on the decoded weights.

On CPU the Triton kinds run through the interpreter with tiny tiles (fma: ROWS=2, BLOCK_N=16, BLOCK_K=64;
dot: BLOCK_M=16, BLOCK_N=16, BLOCK_K=64), so the shapes cross the N tile edge, the K step edge (K a
multiple of 16 only), uneven split edges and several row passes. The Gluon kind is compiled offline for
sm_90 and its K loop inspected. The ``cuda`` tests run the production configs on real V4 / issue shapes,
graph replay == eager, the absence of host syncs and run-to-run bit equality.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from gemm_helpers import every_code_weight, random_weight, rel_err, sync_free_graph
from megamoe.kernels.gemm import nvfp4_splitk as sk
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE
from megamoe.reference import gemm as reference_gemm
from megamoe.reference.quantize import dequantize

FMA, DOT = sk.INTERPRETER_CONFIGS["fma"], sk.INTERPRETER_CONFIGS["dot"]


def _launch(x, w, out, **kw):
    return sk.launch_nvfp4_splitk(x, w.data, w.block_scale, w.global_scale, out, interpreter=not x.is_cuda, **kw)


def _f32(x, w, bias=None):
    y = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t()
    return y + bias.float().cpu() if bias is not None else y


@pytest.mark.parametrize("m,n,k,config,splits", [
    (1, 40, 208, FMA, 3),     # K % 64 != 0: ragged last step; uneven splits (2, 1, 1 steps)
    (3, 40, 256, FMA, None),  # planned splits; 2 row passes of ROWS=2
    (2, 33, 400, FMA, 1),     # one split: the direct bf16 epilogue
    (5, 24, 208, DOT, 2),     # tensor-core step, M not a multiple of BLOCK_M
    (17, 40, 320, DOT, None), # two row passes
])
def test_matches_float32(device, m, n, k, config, splits):
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k).bfloat16().to(device)
    bias = torch.randn(n).bfloat16().to(device)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, w, out, bias=bias, config=config if not x.is_cuda else None, splits=splits)
    assert rel_err(out, _f32(x, w, bias)) < (4e-3 if not x.is_cuda else 1e-2)


def test_scalar_global_scale_and_strided_out(device):
    n, k, m = 48, 192, 2
    w = random_weight((n, k), device)  # 0-d global scale
    x = torch.randn(m, k).bfloat16().to(device)
    big = torch.full((m, n + 8), float("nan"), dtype=torch.bfloat16, device=device)
    out = big[:, :n]  # row stride n + 8
    _launch(x, w, out, splits=2)
    assert rel_err(out, _f32(x, w)) < 4e-3
    assert big[:, n:].isnan().all(), "columns past N must not be written"


@pytest.mark.parametrize("config", [FMA, DOT])
def test_decode_is_exact(device, config):
    """Identity activations give back the decoded weight bit for bit (every E2M1 code, zero / subnormal /
    negative / largest block scales), summed over two K splits."""
    n, k = 16, 128
    w3 = every_code_weight(n, k, device)
    w = type(w3)(w3.data[0], w3.block_scale[0], w3.global_scale.reshape(()), (n, k))
    x = torch.eye(k).bfloat16().to(device)
    out = torch.empty(k, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, config=config if not x.is_cuda else None, splits=2)
    assert torch.equal(out.t().cpu(), dequantize(w.to("cpu"), torch.bfloat16))


def test_deterministic(device):
    n, k, m = 40, 320, 3
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = (torch.randn(m, k) * 3).bfloat16().to(device)
    first = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=device), splits=4)
    second = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=device), splits=4)
    assert torch.equal(first, second)


def _counters(device):
    return sk.splitk_counters(device)


@pytest.mark.parametrize("m,n,k,splits", [
    (1, 40, 16, None),   # K at the minimum (one 16-element block): one split, direct epilogue
    (1, 40, 208, 4),     # single-launch reduction, uneven last split, N % 16 != 0
    (7, 33, 320, None),  # dot kind (M > 4), planned splits, N not a multiple of the tile
    (16, 24, 192, 3),
    (17, 40, 128, 2),    # two row passes of BLOCK_M = 16
    (64, 18, 256, None), # four row passes
])
def test_single_launch_matches_reference(device, m, n, k, splits):
    """The kernel (with its last-program reduction when split) against megamoe/reference/gemm.py, and bit
    for bit against the two-launch reduction; the tile counters are all zero again afterwards."""
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k).bfloat16().to(device)
    bias = torch.randn(n).bfloat16().to(device)
    out = _launch(x, w, torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device), bias=bias,
                  splits=splits, fused=True)
    ref = reference_gemm.nvfp4_linear(x.cpu(), w.to("cpu"), bias.cpu())
    assert rel_err(out, ref) < 4e-3
    assert rel_err(out, _f32(x, w, bias)) < 4e-3
    two = _launch(x, w, torch.empty_like(out), bias=bias, splits=splits, fused=False)
    assert torch.equal(out, two), "single-launch and two-launch reductions differ"
    assert torch.equal(out, _launch(x, w, torch.empty_like(out), bias=bias, splits=splits, fused=True)), \
        "not deterministic"
    assert torch.equal(out, _launch(x, w, torch.empty_like(out), bias=bias, splits=splits)), "automatic choice"
    assert not _counters(device).any(), "tile counters not reset"


def test_counters_are_used(device):
    """A counter left non-zero (e.g. by an aborted launch) makes a program other than the last one reduce:
    the result changes, so the test above would see a missing reset; a second launch restores them. The interpreter
    runs the programs one after the other, so the early reduction misses the later partials every time; on a GPU
    they run at once and the partials may all have landed first (the result is then right): CPU only."""
    if device.type == "cuda":
        pytest.skip("the stale-counter effect depends on the programs' timing on a GPU")
    n, k, m = 40, 256, 2
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k).bfloat16().to(device)
    good = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=device), splits=4)
    counters = _counters(device)
    counters[0] = 1  # column tile 0 starts one ticket ahead
    out = _launch(x, w, torch.zeros(m, n, dtype=torch.bfloat16, device=device), splits=4)
    counters.zero_()
    bad_cols = (out != good).any(0)
    assert bad_cols.any(), "a stale counter went unnoticed: the single-launch reduction is not in use"
    assert torch.equal(_launch(x, w, torch.empty_like(out), splits=4), good)


def test_splitk_counters_cached_per_device():
    a = sk.splitk_counters("cpu")
    assert a is sk.splitk_counters(torch.device("cpu"))
    assert a.dtype == torch.int32 and a.shape == (sk.COUNTER_SLOTS,)


def test_dense_route_table():
    """Host rule: the per-shape-class bound, K % 16, and the overall cap the benchmark lowers."""
    for name, max_elements, max_rows in sk.DENSE_SPLITK_MAX_ROWS:
        assert sk.dense_shape_class(1, max_elements) == (name, max_rows)
    assert sk.splitk_preferred(1, 4096, 4096) and sk.splitk_preferred(64, 18432, 7168)
    assert not sk.splitk_preferred(0, 4096, 4096) and not sk.splitk_preferred(8, 4096, 4104)
    # above the class bound only for a long K loop (measured: gemm_dense_v16), never above the overall cap
    assert sk.splitk_preferred(128, 4096, 4096) and sk.splitk_preferred(256, 18432, 7168)
    assert not sk.splitk_preferred(sk.dense_shape_class(32768, 1024)[1] + 1, 32768, 1024)
    assert not sk.splitk_preferred(sk.SPLITK_MAX_ROWS + 1, 4096, 4096)
    assert sk.splitk_max_rows(32768, 1024) == 64 and sk.splitk_max_rows(4096, 8192) == 256
    assert sk.splitk_max_rows(4096, 2048) == 128 and sk.splitk_max_rows(7168, 3072) == 128  # mid K (gpu_check_v34 c)
    assert sk.splitk_max_rows(4096, 2032) == 64
    # per-class tile configs at M <= 4: the mma.sync kind (128 columns on the largest weights), except M = 1 on the
    # small class (FMA there); without Gluon the FMA kind of SPLITK_CONFIGS (gpu_check_v36 sweep_dense_m1_e)
    for m in (1, 2, 3, 4):
        assert sk.select_splitk_config(m, False, True, 18432, 7168) == sk.MMA_SMALL_M_HUGE_CONFIG
        assert sk.select_splitk_config(m, False, True, 32768, 1024) == sk.MMA_SMALL_M_CONFIG
        assert sk.select_splitk_config(m, False, True, 4096, 8192) == sk.MMA_SMALL_M_CONFIG
        for n, k in ((18432, 7168), (4096, 4096)):
            config = sk.select_splitk_config(m, False, False, n, k)
            assert config[0] == "fma" and config == sk.select_splitk_config(m, False, True), config
    assert sk.select_splitk_config(1, False, True, 4096, 4096) == sk.SPLITK_CONFIGS[1]
    assert sk.select_splitk_config(2, False, True, 1024, 4096) == sk.MMA_SMALL_M_CONFIG
    assert sk.select_splitk_config(8, False, True, 18432, 7168) == sk.SPLITK_CONFIGS[8]
    assert sk.select_splitk_config(8, False, False, 18432, 7168) == sk.DOT_FALLBACK
    assert (sk.select_splitk_config(64, False, True, 18432, 7168)
            == sk.select_splitk_config(64, False, True, 32768, 1024))
    for m in (17, 32, 64, 128, 256):
        config = sk.select_splitk_config(m, False, True)
        assert config[0] == "wgmma" and config[2] == 16 * config[4] and config[1] >= 8 * config[4], config
        assert sk.select_splitk_config(m, False, False) == sk.DOT_FALLBACK


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (8, 1024, 4096), (64, 18432, 7168), (1, 32768, 1024),
                                   (256, 4096, 8192), (1, 7, 16), (3, 100, 1008)])
def test_plan_covers_k_and_fills_the_gpu(m, n, k):
    for kind_config in [*sk.SPLITK_CONFIGS.values(), sk.MMA_SMALL_M_CONFIG, sk.MMA_SMALL_M_HUGE_CONFIG]:
        block_n, block_k, per_sm = kind_config[2], kind_config[3], kind_config[5]
        target = 132 * per_sm
        splits, chunk = sk.plan_splitk(m, n, k, block_n, block_k, target)
        k_steps = -(-k // block_k)
        assert chunk % block_k == 0 and 1 <= splits <= k_steps
        assert (splits - 1) * chunk < k <= splits * chunk, "every split non-empty, K covered"
        if splits > 1:
            assert splits * m * n * 4 <= sk.WORKSPACE_L2_BYTES
        n_tiles = -(-n // block_n)
        if n_tiles * 2 <= target and splits * m * n * 4 * 4 <= sk.WORKSPACE_L2_BYTES and k_steps >= 4:
            assert splits > 1, "small N must be split"


@pytest.mark.parametrize("m,n,k,config,splits", [
    (3, 40, 256, FMA, None),  # planned splits, 2 row passes of ROWS=2
    (2, 34, 208, FMA, 1),     # one split: SwiGLU still goes through the workspace and the reduction
    (17, 48, 320, DOT, 3),    # tensor-core step, M not a multiple of BLOCK_M
])
def test_swiglu_matches_float32(device, m, n, k, config, splits):
    """``swiglu``: out (M, N/2) = SwiGLU of the float32 sums (interleaved gate/up columns), the clamp at a limit that
    bites on about half the values, a NaN row kept NaN, columns past N/2 of a wider buffer untouched."""
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k).bfloat16().to(device)
    x[1, 5] = float("nan")
    y = _f32(x, w)
    limit = float(y[torch.arange(m) != 1].abs().median())
    ref = reference_gemm.swiglu_reference(y, limit)
    big = torch.full((m, n // 2 + 4), 7.0, dtype=torch.bfloat16, device=device)
    out = big[:, : n // 2]
    kw = dict(config=config if not x.is_cuda else None, splits=splits, swiglu=True, swiglu_limit=limit)
    _launch(x, w, out, fused=True, **kw)  # a fused request still takes the two-launch reduction
    rows = torch.arange(m) != 1
    bound = 4e-3 if not x.is_cuda else 1e-2
    assert out[1].isnan().all(), "a NaN row must stay NaN through the clamp"
    assert rel_err(out.cpu()[rows], ref[rows]) < bound
    assert (big[:, n // 2:] == 7).all(), "columns past N/2 must not be written"
    torch.testing.assert_close(out, _launch(x, w, torch.empty_like(out), fused=False, **kw), rtol=0, atol=0,
                               equal_nan=True)
    # the bound separates a wrong kernel: gate and up swapped, or no clamp
    swapped = reference_gemm.swiglu_reference(y[:, torch.arange(n) ^ 1], limit)
    assert rel_err(swapped[rows], ref[rows]) > 20 * bound
    assert rel_err(reference_gemm.swiglu_reference(y, None)[rows], ref[rows]) > 20 * bound


def test_swiglu_needs_an_even_n():
    w = random_weight((15, 32), "cpu")
    with pytest.raises(ValueError, match="even N"):
        _launch(torch.randn(2, 32).bfloat16(), w, torch.empty(2, 7, dtype=torch.bfloat16), swiglu=True)


def test_grouped_arguments_are_refused():
    w = random_weight((16, 32), "cpu")
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(ValueError, match="expert_offsets"):
        _launch(x, w, torch.empty(2, 16, dtype=torch.bfloat16), expert_offsets=torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# Offline sm_90 compile (no GPU needed): registers, spills and the K loops' instruction mix.
# ----------------------------------------------------------------------------------------------


#: Configs outside SPLITK_CONFIGS, by the name the offline tests give them.
NAMED_CONFIGS = {"dot": "DOT_FALLBACK", "small_m": "MMA_SMALL_M_CONFIG", "small_m_huge": "MMA_SMALL_M_HUGE_CONFIG"}


def _config(key):
    return getattr(sk, NAMED_CONFIGS[key]) if key in NAMED_CONFIGS else sk.SPLITK_CONFIGS[key]


def _compile_in_subprocess(key, tmp_path, **flags):
    """sm_90 cubin of the config SPLITK_CONFIGS[key] (or a NAMED_CONFIGS one), compiled in a fresh process (the test
    session may run the interpreter, which replaces jit functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"splitk_{key}.cubin"
    lookup = f"s.{NAMED_CONFIGS[key]}" if key in NAMED_CONFIGS else f"s.SPLITK_CONFIGS[{key}]"
    code = ("import sys; from megamoe.kernels.gemm import nvfp4_splitk as s; "
            f"cfg = {lookup}; "
            f"f = s.compile_for_sm90 if cfg[0] in ('mma', 'wgmma') else s.compile_partial_for_sm90; "
            f"c = f(cfg, **{flags!r}); open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=600)
    return out.read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("key,max_per_weight", [(1, 5.6), (8, 3.4), (16, 4.0), (32, 4.4), (64, 5.8), (1 << 62, 4.8),
                                                ("small_m", 3.6), ("small_m_huge", 3.4)])
def test_sm90_k_loop_is_lean(tmp_path, key, max_per_weight):
    """SASS instructions per weight in the K loop, no local-memory traffic in it, registers within the
    occupancy the split plan assumes (programs_per_sm x num_warps x 32 threads). "small_m" (16 weight rows per warp)
    spends the x operand's work on half the weights of the 32-rows-per-warp configs: 3.5 per weight."""
    tk = pytest.importorskip("test_nvfp4_gluon")  # tests/kernels: its SASS helpers
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    cubin = _compile_in_subprocess(key, tmp_path)
    config = _config(key)
    kind, block_m, block_n, block_k, num_warps, per_sm, _ = config
    loops = [(n, ops) for n, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"] or ops["HGMMA"] or ops["FFMA"]]
    assert len(loops) == 1, loops
    count, ops = loops[0]
    assert not ops["LDL"] and not ops["STL"], ops
    assert count / (block_n * block_k // (32 * num_warps)) <= max_per_weight, (count, ops)
    path = pathlib.Path(tmp_path) / "res.cubin"
    path.write_bytes(cubin)
    res = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
    regs = int(res.split("REG:")[1].split()[0])
    assert regs * 32 * num_warps * per_sm <= 65536, (regs, per_sm)


# ----------------------------------------------------------------------------------------------
# CUDA (the lead's H100 run)
# ----------------------------------------------------------------------------------------------

ISSUE_SHAPES = [(4096, 4096), (1024, 4096), (18432, 7168), (32768, 1024), (4096, 8192)]


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", ISSUE_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 13, 16, 17, 32, 64, 128, 256])
def test_cuda_issue_shapes(n, k, m):
    device = torch.device("cuda")
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16()
    out = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=device), bias=bias)
    assert rel_err(out, _f32(x, w, bias)) < 1e-2
    assert torch.equal(out, _launch(x, w, torch.empty_like(out), bias=bias)), "not deterministic"


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(sk.SPLITK_CONFIGS.values()) + [sk.DOT_FALLBACK, sk.MMA_SMALL_M_CONFIG])
def test_cuda_every_config_and_split(config):
    device = torch.device("cuda")
    n, k, m = 1000, 2048, 37
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k, device=device).bfloat16()
    ref = _f32(x, w)
    for splits in (1, 3, 16):
        out = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16, device=device), config=config, splits=splits,
                      fused=True)
        assert rel_err(out, ref) < 1e-2, (config, splits)
        two = _launch(x, w, torch.empty_like(out), config=config, splits=splits, fused=False)
        assert torch.equal(out, two), ("single-launch and two-launch reductions differ", config, splits)
    assert not sk.splitk_counters(device).any(), "tile counters not reset"


@pytest.mark.cuda
@pytest.mark.parametrize("config", [sk.SPLITK_CONFIGS[1], sk.SPLITK_CONFIGS[8], sk.SPLITK_CONFIGS[64],
                                    sk.SPLITK_CONFIGS[1 << 62], sk.DOT_FALLBACK])
def test_cuda_decode_is_exact(config):
    device = torch.device("cuda")
    n, k = 256, 512
    w3 = every_code_weight(n, k, device)
    w = type(w3)(w3.data[0], w3.block_scale[0], w3.global_scale.reshape(()), (n, k))
    x = torch.eye(k, device=device).bfloat16()
    out = _launch(x, w, torch.empty(k, n, dtype=torch.bfloat16, device=device), config=config, splits=4)
    assert torch.equal(out.t().cpu(), dequantize(w.to("cpu"), torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (8, 1024, 4096), (32, 1024, 4096), (64, 4096, 7168),
                                   (256, 4096, 8192)])
def test_cuda_sync_free_and_graph_replay(m, n, k):
    device = torch.device("cuda")
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    launch = lambda: _launch(x, w, out, bias=bias)  # noqa: E731
    graph, _ = sync_free_graph(launch)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, launch().clone()), "CUDA-graph replay differs from eager"
    assert rel_err(replayed, _f32(x, w, bias)) < 1e-2
    for _ in range(3):  # replays leave the tile counters at zero and keep the bits
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, replayed)
    assert not sk.splitk_counters(device).any(), "tile counters not reset"


V4_DENSE = [(1536, 7168), (7168, 1024), (512, 7168), (4096, 7168), (7168, 2048)]  # q/kv LoRA, out proj, shared


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", V4_DENSE)
@pytest.mark.parametrize("m", [1, 8, 24, 64, 96, 256])
def test_cuda_v4_shapes_through_the_op(n, k, m):
    """nvfp4_linear (decode_route -> split-K up to the shape's bound, sk.splitk_max_rows) on DeepSeek-V4 dense
    projection shapes; above the bound the op's other route."""
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k, device=device).bfloat16()
    assert (ops_gemm.decode_route(x, w.data, m, None, n, k) == "splitk") == (m <= sk.splitk_max_rows(n, k))
    out = ops_gemm.nvfp4_linear(x, w)
    assert rel_err(out, _f32(x, w)) < 1e-2
    assert torch.equal(out, ops_gemm.nvfp4_linear(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 7168), (256, 512)])  # V4-Flash / V4-Pro shared gate_up, small
@pytest.mark.parametrize("m", [9, 16, 33, 64, 256])
def test_cuda_swiglu_through_the_op(n, k, m):
    """nvfp4_linear(activation="swiglu") on the split-K route (the SwiGLU in its reduction) against the float32
    reference and against the grouped one-expert route; deterministic, graph replay == eager, sync-free."""
    from megamoe.ops import gemm as ops_gemm

    device = torch.device("cuda")
    w = random_weight((n, k), device, scale_shape=(n, 1))
    x = torch.randn(m, k, device=device).bfloat16()
    y = _f32(x, w)
    limit = float(y.abs().median())
    ref = reference_gemm.swiglu_reference(y, limit)
    splitk = ops_gemm.decode_route(x, w.data, m, None, n, k) == "splitk"
    assert splitk == (m <= sk.splitk_max_rows(n, k))
    out = torch.empty(m, n // 2, dtype=torch.bfloat16, device=device)
    launch = lambda: ops_gemm.nvfp4_linear(x, w, out=out, activation="swiglu", swiglu_limit=limit)  # noqa: E731
    graph, _ = sync_free_graph(launch)
    eager = out.clone()
    assert rel_err(eager, ref) < 1e-2
    grouped = ops_gemm._dense_as_one_expert(x, w, None, activation="swiglu", swiglu_limit=limit)
    assert rel_err(eager, grouped.float()) < 1e-2
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, launch().clone()), "CUDA-graph replay differs from eager"
    assert rel_err(replayed, reference_gemm.swiglu_reference(_f32(x, w), limit)) < 1e-2


@pytest.mark.cuda
def test_cuda_capture_before_any_eager_call_falls_back():
    """No counters yet while capturing: the two-launch reduction is captured, with the same bits."""
    device = torch.device("cuda")
    saved = sk._COUNTERS.pop(device.__class__("cuda", torch.cuda.current_device()), None)
    try:
        n, k, m = 1024, 4096, 8
        w = random_weight((n, k), device, scale_shape=(n, 1))
        x = torch.randn(m, k, device=device).bfloat16()
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        _launch(x, w, torch.empty_like(out), fused=False)  # compile outside the capture
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                _launch(x, w, out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _launch(x, w, torch.empty_like(out)))
    finally:
        if saved is not None:
            sk._COUNTERS[device.__class__("cuda", torch.cuda.current_device())] = saved


# --- PDL and early weight reads (kernels/pdl.py; ``weight_settled``) -------------------------------------------------

def test_early_reads_rule(monkeypatch):
    """Early weight reads only where the caller vouched for the weights, "splitk" is in PDL_EARLY_READS and each
    program makes one row pass of the mma.sync or CUDA-core kind (the latter with K % BLOCK_K == 0)."""
    from megamoe.kernels import pdl

    monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset({"splitk"}))
    assert sk.splitk_early_reads(True, "fma", 1, 1, True)
    assert sk.splitk_early_reads(True, "mma", 8, 8, True)
    assert not sk.splitk_early_reads(False, "mma", 8, 8, True), "no promise, no early reads"
    assert not sk.splitk_early_reads(True, "mma", 9, 8, True), "two row passes"
    assert not sk.splitk_early_reads(True, "fma", 1, 1, False), "ragged K on the CUDA-core kind"
    assert not sk.splitk_early_reads(True, "wgmma", 32, 32, True)
    assert not sk.splitk_early_reads(True, "dot", 16, 16, True)
    monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset())
    assert not sk.splitk_early_reads(True, "fma", 1, 1, True)


class _LaunchSpy:
    """Wraps a jit kernel: records the constexprs of each launch and runs it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append({k: v for k, v in kwargs.items() if k in ("PDL", "EARLY_READS", "launch_pdl")})
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("m,n,k,splits", [(1, 40, 256, 3), (2, 33, 384, None), (2, 40, 192, 1)])
def test_interpreter_early_reads_same_bits(monkeypatch, m, n, k, splits):
    """The CUDA-core kind built with PDL and EARLY_READS (forced on: the interpreter has no PDL; its wait is a no-op)
    gives the bits of the plain build: split, single-launch reduction and one-split direct epilogue."""
    from megamoe.kernels import pdl

    w = random_weight((n, k), "cpu", scale_shape=(n, 1))
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    plain = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16), bias=bias, config=FMA, splits=splits)
    spy = _LaunchSpy(sk._splitk_partial_kernel)
    monkeypatch.setattr(sk, "_splitk_partial_kernel", spy)
    monkeypatch.setattr(sk, "pdl_flags", lambda t, kernel, single_pass=True: (True, False))
    monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset({"splitk"}))
    early = _launch(x, w, torch.empty(m, n, dtype=torch.bfloat16), bias=bias, config=FMA, splits=splits,
                    weight_settled=True)
    assert spy.calls == [dict(PDL=True, EARLY_READS=True, launch_pdl=False)]
    assert torch.equal(early, plain)
    assert rel_err(early, _f32(x, w, bias)) < 4e-3


def test_weight_settled_must_be_a_bool():
    from megamoe.ops.gemm import nvfp4_linear

    w = random_weight((16, 64), "cpu")
    with pytest.raises(TypeError, match="weight_settled"):
        nvfp4_linear(torch.randn(1, 64).bfloat16(), w, weight_settled=1)


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
def test_sm90_early_reads_builds_wait_before_writes():
    """Offline sm_90 builds of the CUDA-core and mma.sync kinds with EARLY_READS: a weight load before the
    ``griddepcontrol.wait`` but no path to a global store or atomic before it; the wgmma kind waits first."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ["splitk_fma_early", "splitk_mma_early", "splitk_wgmma"]
    script = pathlib.Path(__file__).resolve().parents[1] / "pdl_sm90_compile.py"
    run = subprocess.run([sys.executable, str(script), *names], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        off, on = report[name]["off"], report[name]["on"]
        assert off["wait"] == 0 and off["launch"] == 0 and not off["metadata_pdl"], (name, off)
        assert on["wait"] == 1 and on["launch"] == 1 and on["wait_before_writes"] and on["metadata_pdl"], (name, on)
        assert on["wait_first"] == (name == "splitk_wgmma"), (name, on)


@pytest.mark.cuda
@pytest.mark.parametrize("setting", ["pdl", "early"])
def test_cuda_pdl_chain_equals_plain_and_sync_free(monkeypatch, setting):
    """A chain of dense linears where each one's x is the previous one's output (the race an early x read would
    lose), at every split-K kind and row count from 1 to 64, launched with PDL (and with early weight reads):
    graph replay == eager == the plain launches, bit for bit, with no host sync; counters left zero."""
    from megamoe.kernels import pdl
    from megamoe.ops.gemm import nvfp4_linear

    device = torch.device("cuda")
    torch.manual_seed(0)
    dims = [4096, 4096, 1024, 4096, 7168, 1536, 7168]  # 4096x4096, 1024x4096, 4096x1024, 7168x4096, ...
    weights = [random_weight((dims[i + 1], dims[i]), device, scale_shape=(dims[i + 1], 1))
               for i in range(len(dims) - 1)]
    for m in (1, 2, 4, 8, 12, 16, 32, 64):
        x = torch.randn(m, dims[0], device=device).bfloat16()
        outs = [torch.empty(m, d, dtype=torch.bfloat16, device=device) for d in dims[1:]]

        def chain():
            h = x
            for w, out in zip(weights, outs):
                h = nvfp4_linear(h, w, out=out, weight_settled=True)
            return [o.clone() for o in outs]

        with monkeypatch.context() as mp:
            mp.setattr(pdl, "PDL_LAUNCH", frozenset())
            mp.setattr(pdl, "PDL_PROLOGUE", frozenset())
            plain = chain()
        monkeypatch.setattr(pdl, "PDL_LAUNCH", frozenset({"splitk"}))
        monkeypatch.setattr(pdl, "PDL_EARLY_READS", frozenset({"splitk"} if setting == "early" else set()))
        eager = chain()
        graph, _ = sync_free_graph(chain)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b, c) in enumerate(zip(plain, eager, outs)):
            assert torch.equal(a, b), f"M={m} link {i}: PDL eager differs from plain"
            assert torch.equal(a, c), f"M={m} link {i}: PDL graph replay differs from plain"
        assert not sk.splitk_counters(device).any(), "tile counters not reset"


@pytest.mark.parametrize("n,splits,fused,single_pass", [
    (40, 4, None, True),    # 3 column tiles x 4 splits = 12 programs <= 12, the single-launch reduction
    (40, 4, False, False),  # a second (reduction) launch
    (80, 4, None, False),   # 5 x 4 = 20 programs > one wave of 12
    (40, 1, None, True),    # one split: the direct epilogue
])
def test_pdl_launch_only_for_one_launch_of_one_wave(monkeypatch, n, splits, fused, single_pass):
    """The launcher asks for a PDL launch (``single_pass``) only where the grid is one launch that fits in one wave of
    the config's programs per SM (the interpreter plans for INTERPRETER_PROGRAMS)."""
    asked = []

    def flags(t, kernel, single_pass=True):
        asked.append((kernel, single_pass))
        return False, False

    monkeypatch.setattr(sk, "pdl_flags", flags)
    w = random_weight((n, 256), "cpu")
    x = torch.randn(1, 256).bfloat16()
    _launch(x, w, torch.empty(1, n, dtype=torch.bfloat16), config=FMA, splits=splits, fused=fused)
    assert asked == [("splitk", single_pass)]
