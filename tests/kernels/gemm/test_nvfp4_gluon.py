"""Gluon NVFP4 GEMMs for sm_90: the mma.sync decode kernel (megamoe/kernels/gemm/nvfp4_mma_decode.py) and
the wgmma prefill kernel (megamoe/kernels/gemm/nvfp4_wgmma.py), with their shared nvfp4_gluon_jit.py.

Gluon kernels do not run in the Triton interpreter. On CPU the kernels are
compiled for sm_90 (Triton's bundled ptxas, no GPU needed) and their K loops
are inspected: the point of these kernels is that decoding FP4 into the MMA
operand registers costs ~3 instructions per weight with no shared-memory round
trip for the weights, and a layout change that re-introduces conversions fails
these tests. The ``cuda`` tests check the numbers against float32 math on the
decoded weights, bit-exact decoding, graph capture and the absence of host
syncs.
"""
import collections
import os
import re
import shutil
import subprocess
import sys

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
)
from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.kernels.gemm import nvfp4_wgmma as wgmma
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE, gluon_supports
from megamoe.reference.gemm import interleave_gate_up, swiglu_reference
from megamoe.reference.quantize import dequantize, quantize

gluon_only = pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")


def _cuobjdump():
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


def _inner_loops(cubin: bytes, tmp_path):
    """[(instruction count, Counter of opcodes)] of the innermost loops in a cubin's SASS."""
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, text in code:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    loops = []
    for lo, hi in inner:
        body = [t for a, t in code if lo <= a <= hi]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        loops.append((len(body), ops))
    return loops


def _compile_in_subprocess(config, flags, tmp_path, kind="mma") -> bytes:
    """sm_90 cubin of the kernel, compiled in a fresh process: the test session may run Triton's
    interpreter (TRITON_INTERPRET=1), which replaces jit functions and cannot compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel.cubin"
    module = {"mma": "nvfp4_mma_decode", "wgmma": "nvfp4_wgmma", "pipe": "nvfp4_wgmma_pipe"}[kind]
    code = (f"import sys; from megamoe.kernels.gemm.{module} import compile_for_sm90; "
            f"c = compile_for_sm90({tuple(config)!r}, **{flags!r}); open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=600)
    return out.read_bytes()


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("config,flags,max_per_weight", [
    ((8, 128, 256, 4), dict(grouped=True, row_index=True, swiglu=True), 3.4),
    ((8, 128, 128, 4), dict(grouped=True, row_index=True, swiglu=True), 3.4),
    ((16, 128, 128, 4), dict(grouped=True, row_index=False), 3.8),
    ((8, 64, 256, 4), dict(grouped=False, row_index=False, bias=True), 3.6),
])
def test_sm90_k_loop_is_lean(tmp_path, config, flags, max_per_weight):
    """SASS instructions per weight in the decode kernel's K loop."""
    block_m, block_n, block_k, num_warps = config
    loops = _inner_loops(_compile_in_subprocess(config, flags, tmp_path), tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    weights_per_thread = block_n * block_k // (32 * num_warps)
    # one mma.m16n8k16 per (16 weight rows, 16 K, 8 tokens) per warp
    assert ops["HMMA"] == (block_n // num_warps // 16) * (block_k // 16) * (block_m // 8)
    # per step and thread, vectorised: 16 bytes of weights per 128 K and one load of scale bytes per
    # weight row, 16 bytes of activations per 32 K and token row
    rows = block_n // num_warps // 8
    assert ops["LDG"] == rows * (block_k // 128) + rows + (block_m // 8) * (block_k // 32)
    assert not ops["LDS"] and not ops["STS"] and not ops["LDL"] and not ops["STL"] and not ops["SHFL"]
    assert count / weights_per_thread <= max_per_weight, (count, ops)


@gluon_only
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
def test_sm90_wgmma_k_loop(tmp_path):
    """The prefill kernel's K loop: one 64xBLOCK_Mx16 wgmma per 16 K per warpgroup, no register spills,
    decode at about 4 instructions per weight (the x^T tile staging adds ~1)."""
    block_m, block_n, block_k, num_warps, _ = config = wgmma.WGMMA_CONFIG
    loops = _inner_loops(_compile_in_subprocess(config, dict(swiglu=True), tmp_path, kind="wgmma"), tmp_path)
    k_loops = [(n, ops) for n, ops in loops if ops["HGMMA"]]
    assert len(k_loops) == 1, loops
    count, ops = k_loops[0]
    assert ops["HGMMA"] == block_k // 16
    assert not ops["LDL"] and not ops["STL"] and not ops["SHFL"]
    assert count / (block_n * block_k // (32 * num_warps)) <= 4.6, (count, ops)


def test_rules_are_host_shape_buckets():
    bound = mma.MMA_DECODE_MAX_ROWS_PER_EXPERT
    assert mma.mma_decode_preferred(8, 256) and mma.mma_decode_preferred(bound * 256, 256)
    assert not mma.mma_decode_preferred(bound * 256 + 1, 256)
    assert not mma.mma_decode_preferred(1, None)  # dense: no split-K yet
    assert mma.select_mma_decode_config(1, 7168)[0] == 8 and mma.select_mma_decode_config(9, 7168)[0] == 32
    assert all(1024 % mma.select_mma_decode_config(r, 1024)[2] == 0 for r in (1, 8, 64))
    assert mma.select_mma_decode_config(1, 640)[2] == 128
    assert wgmma.wgmma_preferred(128 * 256, 256) and not wgmma.wgmma_preferred(bound * 256, 256)
    assert not wgmma.wgmma_preferred(wgmma.WGMMA_MAX_ROWS_PER_EXPERT * 256 + 1, 256)
    assert not wgmma.wgmma_preferred(4096, None)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not gluon_supports(x, torch.zeros(8, 128, dtype=torch.uint8))  # CPU tensors


def test_interpreter_is_refused():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    w = quantize(torch.randn(16, 128))
    out = torch.empty(1, 16, dtype=torch.bfloat16)
    for launch in (mma.launch_nvfp4_mma_decode, wgmma.launch_nvfp4_wgmma):
        with pytest.raises(ValueError, match="interpreter"):
            launch(x, w.data, w.block_scale, w.global_scale, out, interpreter=True)


# ----------------------------------------------------------------------------- GPU

CONFIGS = [(8, 128, 128, 4), (16, 128, 128, 4), (8, 64, 256, 4), (32, 256, 128, 8)]


def _launch(x, w, out, offsets=None, **kw):
    return mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("counts", [[1, 0, 5, 1], [0, 0, 0, 0], [40, 3, 0, 17], [0, 0, 0, 2]])
def test_cuda_grouped_matches_float32(config, counts):
    device = torch.device("cuda")
    e, n, k = len(counts), 200, 512  # N not a multiple of BLOCK_N; experts with more rows than BLOCK_M
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 3  # 3 padding rows
    x = torch.randn(t, k, device=device).bfloat16()
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of(counts, device), config=config)
    real = sum(counts)
    assert (out[real:] == 0).all(), "padding rows must be 0"
    if real:
        assert rel_err(out[:real], grouped_f32(x, w, offsets_of(counts, "cpu"))[:real]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS[:2])
def test_cuda_row_index_per_row_scale(config):
    device = torch.device("cuda")
    e, n, k, s = 3, 256, 384, 11
    w = random_weight((e, n, k), device, scale_shape=(e, n, 1))
    counts = [2, 0, 9]
    t = sum(counts) + 1
    x = torch.randn(s, k, device=device).bfloat16()
    row_index = torch.randint(0, s, (t,), dtype=torch.int32, device=device)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of(counts, device), row_index=row_index, config=config)
    ref = grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)
    assert rel_err(out[:11], ref[:11]) < 4e-3
    assert (out[11:] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("config", CONFIGS)
def test_cuda_swiglu(limit, config):
    device = torch.device("cuda")
    e, i, k = 2, 96, 256
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    counts = [3, 12]
    t = sum(counts) + 1
    x = (torch.randn(t, k, device=device) * 20).bfloat16()
    out = torch.full((t, i), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, interleave_gate_up(plain), out, offsets_of(counts, device), swiglu=True, swiglu_limit=limit,
            config=config)
    y = grouped_f32(x, plain, offsets_of(counts, "cpu"))
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    if limit is not None:
        assert (y.abs() > limit).any()
    assert rel_err(out[:15], swiglu_reference(inter, limit)[:15]) < 4e-3
    assert (out[15:] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 5, 16, 37])
def test_cuda_dense_with_bias_and_nan_block(m):
    device = torch.device("cuda")
    n, k = 136, 640
    src = torch.randn(n, k) * 0.05
    src[5, 16:32] = float("nan")
    w = quantize(src, per_row=True).to(device)
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, bias=bias)
    ref = x.float().cpu() @ dequantize(w.to("cpu"), torch.float32).t() + bias.float().cpu()
    keep = torch.arange(n) != 5
    assert torch.isnan(out[:, 5].cpu()).all()
    assert rel_err(out[:, keep], ref[:, keep]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS)
def test_cuda_decode_is_exact(config):
    """x = identity rows, global scale 1: out = the decoded weight bit for bit (every code, odd scales)."""
    assert_exact_decode(lambda x, w, out, offsets: _launch(x, w, out, offsets, config=config), 32, 256,
                        torch.device("cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_cuda_moe_shapes_sync_free_and_graph(tokens):
    device = torch.device("cuda")
    e, n, k = 32, 512, 1024
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = 8 * tokens
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t + 2, k, device=device).bfloat16()  # 2 padding rows
    out = torch.full((t + 2, n), 3.0, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets)
    assert rel_err(out[:t], grouped_f32(x, w, offsets)[:t]) < 1e-2
    assert (out[t:] == 0).all()
    check_sync_free_and_graph(lambda: _launch(x, w, out, offsets), x, offsets, t)
    assert rel_err(out[:t], grouped_f32(x, w, offsets)[:t]) < 1e-2


# ----------------------------------------------------------------------------- wgmma (prefill) kernel, GPU

WGMMA_CONFIGS = [(128, 128, 128, 8, 1), (128, 128, 64, 8, 2), (64, 64, 128, 4, 2)]


@pytest.mark.cuda
@pytest.mark.parametrize("config", WGMMA_CONFIGS)
@pytest.mark.parametrize("counts", [[300, 0, 5, 129], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 260]])
def test_cuda_wgmma_grouped_matches_float32(config, counts):
    device = torch.device("cuda")
    e, n, k = len(counts), 200, 512
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    wgmma.launch_nvfp4_wgmma(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets_of(counts, device),
                           row_index=row_index, config=config)
    real = sum(counts)
    assert (out[real:] == 0).all(), "padding rows must be 0"
    if real:
        ref = grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)
        assert rel_err(out[:real], ref[:real]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [None, 0.5])
def test_cuda_wgmma_swiglu_and_dense_bias(limit):
    device = torch.device("cuda")
    e, i, k = 2, 96, 256
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    counts = [150, 40]
    t = sum(counts) + 1
    x = (torch.randn(t, k, device=device) * 20).bfloat16()
    out = torch.empty(t, i, dtype=torch.bfloat16, device=device)
    wi = interleave_gate_up(plain)
    wgmma.launch_nvfp4_wgmma(x, wi.data, wi.block_scale, wi.global_scale, out,
                           expert_offsets=offsets_of(counts, device), swiglu=True, swiglu_limit=limit)
    y = grouped_f32(x, plain, offsets_of(counts, "cpu"))
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    assert rel_err(out[:190], swiglu_reference(inter, limit)[:190]) < 4e-3 and (out[190:] == 0).all()
    dense = quantize(torch.randn(136, 640) * 0.05, per_row=True).to(device)
    xd = torch.randn(300, 640, device=device).bfloat16()
    bias = torch.randn(136, device=device).bfloat16()
    od = torch.empty(300, 136, dtype=torch.bfloat16, device=device)
    wgmma.launch_nvfp4_wgmma(xd, dense.data, dense.block_scale, dense.global_scale, od, bias=bias,
                           config=(128, 128, 128, 8, 1))
    ref = xd.float().cpu() @ dequantize(dense.to("cpu"), torch.float32).t() + bias.float().cpu()
    assert rel_err(od, ref) < 4e-3


@pytest.mark.cuda
def test_cuda_wgmma_decode_is_exact():
    assert_exact_decode(lambda x, w, out, offsets: wgmma.launch_nvfp4_wgmma(
        x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets), 128, 256, torch.device("cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("x_ring", [0, 4])  # today's loop and the x ring (test_nvfp4_wgmma_x_ring.py)
def test_cuda_wgmma_sync_free_and_graph(x_ring):
    device = torch.device("cuda")
    e, n, k, t = 16, 256, 512, 1500
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t, k, device=device).bfloat16()
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)

    def launch():
        return wgmma.launch_nvfp4_wgmma(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                        x_ring=x_ring)

    launch()
    check_sync_free_and_graph(launch, x, offsets, t)
    assert rel_err(out, grouped_f32(x, w, offsets)) < 1e-2
