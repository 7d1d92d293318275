"""The warp-specialized Gluon wgmma grouped GEMM (megamoe/kernels/gemm/nvfp4_wgmma_ws.py).

CPU: the kernel is compiled for sm_90 (no GPU needed) and its SASS is inspected: the consumer's K
loop issues only async wgmma from shared-memory descriptors (HGMMA with ``gdesc``), waits on an
mbarrier and has no register spills; the producer's K loop gathers activations with cp.async
(LDGSTS), arrives on the mbarrier, and decodes without spills worth a step. Routing stays off by
default. ``cuda``: numbers against float32 math on the decoded weights, bit-exact decode, the
non-warp-specialized debugging variant, graph replay == eager and no host syncs, V4 shapes.
"""
import os
import re
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
from megamoe.kernels.gemm import nvfp4_wgmma_ws as ws
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE
from megamoe.ops import gemm as ops_gemm
from megamoe.reference.gemm import interleave_gate_up, swiglu_reference

gluon_only = pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")


def _cuobjdump():
    import shutil

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


def _sass(config, flags, tmp_path) -> str:
    """SASS of the kernel compiled for sm_90 in a fresh process (the test session may run Triton's
    interpreter, which replaces jit functions and cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel.cubin"
    code = ("import sys; from megamoe.kernels.gemm.nvfp4_wgmma_ws import compile_for_sm90; "
            f"c = compile_for_sm90({tuple(config)!r}, **{flags!r}); open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=600, cwd=os.getcwd())
    return subprocess.run([_cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout


def _loops(sass: str):
    """[(opcode list)] of the innermost backward-branch loops."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, text in code:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[t for a, t in code if lo <= a <= hi] for lo, hi in inner]


def _ops(body, name):
    return [t for t in body if re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] == name]


@gluon_only
@pytest.mark.slow
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
@pytest.mark.parametrize("config,flags", [(ws.WS_CONFIG_LARGE, dict(swiglu=True)),
                                          (ws.WS_CONFIG_SMALL, dict(swiglu=False))])
def test_sm90_partitions(tmp_path, config, flags):
    block_m, block_n, block_k = config[:3]
    sass = _sass(config, flags, tmp_path)
    assert "USETMAXREG" in sass, "no warp-specialized register split"
    loops = _loops(sass)
    consumer = [b for b in loops if _ops(b, "HGMMA")]
    producer = [b for b in loops if _ops(b, "LDGSTS")]
    assert len(consumer) == 1 and len(producer) == 1, [len(b) for b in loops]
    mma = _ops(consumer[0], "HGMMA")
    # one 64 x BLOCK_M x 16 wgmma per 16 K per warpgroup, both operands from shared-memory descriptors
    assert len(mma) == block_k // 16
    assert all(re.match(rf"HGMMA\.64x{block_m}x16\.F32\.BF16 R\d+, gdesc\[", t) for t in mma), mma
    assert _ops(consumer[0], "SYNCS"), "the consumer must wait on / arrive at mbarriers"
    assert not _ops(consumer[0], "LDL") and not _ops(consumer[0], "STL")
    # producer: cp.async rows of x (16 bytes each), the per-thread cp.async mbarrier arrive, decode stores
    rows_per_pass = 32 * config[5] // (block_k // 8)
    assert len(_ops(producer[0], "LDGSTS")) == block_m // rows_per_pass
    assert _ops(producer[0], "ARRIVES") and _ops(producer[0], "STS")
    assert len(_ops(producer[0], "LDL")) + len(_ops(producer[0], "STL")) <= 8


@gluon_only
@pytest.mark.slow
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
def test_sm90_tma_activations(tmp_path):
    """Contiguous rows: the producer loads the activation tile with one TMA box per step (no cp.async)."""
    sass = _sass(ws.WS_CONFIG_LARGE, dict(row_index=False, swiglu=True), tmp_path)
    producer = [b for b in _loops(sass) if _ops(b, "HMUL2")]
    assert len(producer) == 1
    assert _ops(producer[0], "UTMALDG") and not _ops(producer[0], "LDGSTS")
    assert not _ops(producer[0], "LDL") and not _ops(producer[0], "STL")


@gluon_only
@pytest.mark.slow
@pytest.mark.skipif(_cuobjdump() is None, reason="needs cuobjdump (ships with Triton's NVIDIA backend)")
def test_sm90_flat_variant_compiles(tmp_path):
    sass = _sass(ws.WS_CONFIG_LARGE, dict(flat=True), tmp_path)
    assert "USETMAXREG" not in sass and "HGMMA" in sass and "LDGSTS" in sass


def test_route_defaults_and_host_rules(monkeypatch):
    assert ws.ws_preferred(128 * 256, 256, 4096) and not ws.ws_preferred(127 * 256, 256, 4096)
    assert not ws.ws_preferred(1 << 20, None, 4096) and not ws.ws_preferred(1 << 20, 8, 4096 + 64)
    assert ws.select_ws_config(384 * 256, 256) == ws.WS_CONFIG_SMALL
    assert ws.select_ws_config(1024 * 256, 256) == ws.WS_CONFIG_LARGE
    if "MEGAMOE_WS_ROUTE" not in os.environ:  # large batches on by default, the banded top band off
        assert ops_gemm.WS_ROUTE is True and ops_gemm.WS_BANDED is False
    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", False)  # the pipelined kernel takes precedence when on
    monkeypatch.setattr(ops_gemm, "WS_BANDED", False)
    assert all(r != "ws" for r, _ in ops_gemm.plan_row_bands(6 * 4096, 256, 4096, 4096))
    monkeypatch.setattr(ops_gemm, "WS_BANDED", True)
    plan = ops_gemm.plan_row_bands(6 * 4096, 256, 4096, 4096)
    assert plan[-1][0] == "ws" and plan[-1][1]["row_lo"] > 0
    assert ops_gemm._launcher("ws") is ws.launch_nvfp4_wgmma_ws


def test_interpreter_and_dense_are_refused():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    w = random_weight((2, 128, 128), "cpu")
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter"):
        ws.launch_nvfp4_wgmma_ws(x, w.data, w.block_scale, w.global_scale, out, interpreter=True)
    with pytest.raises(ValueError, match="expert_offsets"):
        ws.launch_nvfp4_wgmma_ws(x, w.data[0], w.block_scale[0], w.global_scale, out)
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="x_tma"):
        ws.launch_nvfp4_wgmma_ws(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                 row_index=torch.arange(4, dtype=torch.int32), x_tma=True)


# ----------------------------------------------------------------------------- GPU

CUDA_CONFIGS = [ws.WS_CONFIG_LARGE, ws.WS_CONFIG_SMALL]


def _launch(x, w, out, offsets, **kw):
    return ws.launch_nvfp4_wgmma_ws(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["gather", "tma", "flat"])
@pytest.mark.parametrize("config", CUDA_CONFIGS)
@pytest.mark.parametrize("counts", [[300, 0, 5, 129], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 600]])
def test_cuda_grouped_matches_float32(config, counts, variant):
    """variant: WS with cp.async row gathers (row_index), WS with TMA activation tiles (contiguous rows),
    and the non-warp-specialized debugging variant (row_index)."""
    device = torch.device("cuda")
    e, n, k = len(counts), 200, 512  # N not a multiple of BLOCK_N, experts not multiples of BLOCK_M
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = sum(counts) + 3
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = None if variant == "tma" else torch.randperm(t, device=device).to(torch.int32)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of(counts, device), row_index=row_index, config=config, flat=variant == "flat",
            x_tma=variant == "tma")
    real = sum(counts)
    assert (out[real:] == 0).all(), "padding rows must be 0"
    if real:
        ref = grouped_f32(x, w, offsets_of(counts, "cpu"), row_index)
        assert rel_err(out[:real], ref[:real]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("config", CUDA_CONFIGS)
def test_cuda_swiglu_per_row_scale(limit, config):
    device = torch.device("cuda")
    e, i, k = 2, 96, 256
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 2 * i, 1))
    counts = [150, 300]
    t = sum(counts) + 1
    x = (torch.randn(t, k, device=device) * 20).bfloat16()
    out = torch.empty(t, i, dtype=torch.bfloat16, device=device)
    wi = interleave_gate_up(plain)
    _launch(x, wi, out, offsets_of(counts, device), swiglu=True, swiglu_limit=limit, config=config)
    y = grouped_f32(x, plain, offsets_of(counts, "cpu"))
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    if limit is not None:
        assert (y.abs() > limit).any()
    assert rel_err(out[:450], swiglu_reference(inter, limit)[:450]) < 4e-3 and (out[450:] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("config", CUDA_CONFIGS)
def test_cuda_decode_is_exact(config, flat):
    """x = identity rows, global scale 1: out = the decoded weight bit for bit (every code, odd scales)."""
    assert_exact_decode(lambda x, w, out, offsets: _launch(x, w, out, offsets, config=config, flat=flat), 128, 256,
                        torch.device("cuda"))


@pytest.mark.cuda
def test_cuda_flat_and_ws_agree_bitwise():
    """Same tiles, same wgmma K order: the debugging variant and the WS kernel (TMA or cp.async
    activations) give the same bits."""
    device = torch.device("cuda")
    e, n, k, t = 8, 256, 1024, 3000
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t, k, device=device).bfloat16()
    a = _launch(x, w, torch.empty(t, n, dtype=torch.bfloat16, device=device), offsets)
    b = _launch(x, w, torch.empty(t, n, dtype=torch.bfloat16, device=device), offsets, flat=True)
    c = _launch(x, w, torch.empty(t, n, dtype=torch.bfloat16, device=device), offsets, x_tma=False)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.cuda
def test_cuda_bad_row_index_is_flagged():
    device = torch.device("cuda")
    e, n, k, t = 2, 128, 256, 300
    w = random_weight((e, n, k), device)
    x = torch.randn(10, k, device=device).bfloat16()
    row_index = torch.randint(0, 10, (t,), dtype=torch.int32, device=device)
    row_index[17] = 10_000
    err = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets_of([100, 200], device), row_index=row_index, error_word=err)
    from megamoe.ops import errors

    if errors.DEVICE_GUARD:
        assert err.item() != 0
    ref = grouped_f32(x, w, offsets_of([100, 200], "cpu"), row_index.clamp(max=9))
    keep = torch.arange(t) != 17
    assert rel_err(out[keep], ref[keep]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("h,i,e,rows_per_expert", [(4096, 2048, 8, 1024), (7168, 3072, 8, 256)])
def test_cuda_v4_shapes_sync_free_and_graph(h, i, e, rows_per_expert):
    """V4 gate_up (SwiGLU) and down shapes through the public op with the route switched on."""
    device = torch.device("cuda")
    t = e * rows_per_expert
    gate_up = random_weight((e, 2 * i, h), device, scale_shape=(e, 1, 1))
    down = random_weight((e, h, i), device, scale_shape=(e, 1, 1))
    offsets = uniform_offsets(e, t, device)
    x = torch.randn(t, h, device=device).bfloat16()
    xd = torch.randn(t, i, device=device).bfloat16()
    assert ws.ws_preferred(t, e, h)
    y = torch.empty(t, h, dtype=torch.bfloat16, device=device)
    g = torch.empty(t, i, dtype=torch.bfloat16, device=device)

    def launch_down():
        return _launch(xd, down, y, offsets)

    def launch_gate_up():
        return _launch(x, gate_up, g, offsets, swiglu=True, swiglu_limit=10.0)

    launch_down()
    assert rel_err(y, grouped_f32(xd, down, offsets)) < 4e-3
    check_sync_free_and_graph(launch_down, xd, offsets, t)
    check_sync_free_and_graph(launch_gate_up, x, offsets, t)


@pytest.mark.cuda
def test_cuda_op_route_switch(monkeypatch):
    device = torch.device("cuda")
    e, n, k, t = 4, 256, 512, 4 * 600
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    x = torch.randn(t, k, device=device).bfloat16()
    offsets = offsets_of([600] * e, device)
    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", False)  # the pipelined kernel takes precedence when on
    monkeypatch.setattr(ops_gemm, "WS_ROUTE", True)
    assert ops_gemm.decode_route(x, w.data, t, e, n, k) == "ws"
    out = ops_gemm.nvfp4_grouped_mm(x, w, offsets)
    assert rel_err(out, grouped_f32(x, w, offsets)) < 4e-3
    monkeypatch.setattr(ops_gemm, "WS_ROUTE", False)
    assert ops_gemm.decode_route(x, w.data, t, e, n, k) != "ws"
