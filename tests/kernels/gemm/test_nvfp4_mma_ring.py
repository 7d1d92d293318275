"""The cp.async weight ring of the mma.sync decode kernel (``STAGES`` >= 2; env ``MEGAMOE_MMA_STAGES``; peer study,
benchmarks/NOTES_peer_study.md): offline sm_90 K-loop shape, the env switch, and (CUDA) the same bits as the
register-double-buffered path on V4-Flash expert shapes, float32 reference, exact decode, graph == eager.
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
    random_codes_weight,
    rel_err,
    uniform_offsets,
)
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE
from megamoe.reference.gemm import interleave_gate_up, swiglu_reference

RING = (32, 128, 128, 4, 4)  # the BLOCK_M 32 band config with a 4-stage ring
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _cuobjdump():
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else shutil.which("cuobjdump")


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_env_switch_adds_stages_to_the_band_config():
    """MEGAMOE_MMA_STAGES=4: the BLOCK_M 32 config (the (8, 64] row band) carries 4 stages; the BLOCK_M 8
    decode config and the default (unset) are unchanged. The plan is taken with the pipelined kernel off
    (MEGAMOE_PIPE_ROUTE=0), which otherwise takes the 32-row band at 512 tokens."""
    code = ("from megamoe.kernels.gemm import nvfp4_mma_decode as m; from megamoe.ops.gemm import plan_row_bands; "
            "print(m.select_mma_decode_config(12, 4096), m.select_mma_decode_config(2, 4096), "
            "[b[1].get('config') for b in plan_row_bands(3072, 256, 4096, 512)])")
    for stages, wide in (("4", "(32, 128, 128, 4, 4)"), ("", "(32, 128, 128, 4)")):
        env = dict(_env(), MEGAMOE_MMA_STAGES=stages, MEGAMOE_PIPE_ROUTE="0")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=_ROOT, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        assert out.startswith(wide + " (8, 128, 256, 4)"), out
        assert out.count(wide) == 2, out  # the band plan uses it too


def test_ring_needs_16_byte_aligned_scale_rows():
    """cp.async copies of scale rows need provable 16-byte alignment; otherwise the launch keeps registers."""
    from megamoe.kernels.gemm.nvfp4_mma_decode import ring_stages

    assert ring_stages(4, 1 << 20, (4096 * 256, 256)) == 4  # V4: K = 4096 -> 256 scale bytes per row
    assert ring_stages(4, 1 << 20, (0, 448)) == 4  # dense (no expert stride), K = 7168
    assert ring_stages(4, 1 << 20, (200 * 24, 24)) == 0  # K = 384: rows 8-byte aligned only
    assert ring_stages(4, (1 << 20) + 8, (4096 * 256, 256)) == 0  # base address not 16-byte aligned
    assert ring_stages(1, 1 << 20, (4096 * 256, 256)) == 0 and ring_stages(0, 0, (0, 0)) == 0


@pytest.mark.skipif(not GLUON_AVAILABLE or _cuobjdump() is None, reason="needs Gluon and cuobjdump")
@pytest.mark.parametrize("swiglu", [True, False])
def test_sm90_ring_k_loop(tmp_path, swiglu):
    """The ring's K loop: 16-byte cp.async per weight row and 128 K, one 8-byte cp.async of a row's scale bytes,
    weights and scales read back from shared memory (no LDG of weights), x still one LDG.128 per 32 K and 8
    tokens, the same HMMA count, no local memory, <= 5.0 SASS per weight."""
    out = tmp_path / "k.cubin"
    code = ("import sys; from megamoe.kernels.gemm.nvfp4_mma_decode import compile_for_sm90; "
            f"c = compile_for_sm90({RING!r}, swiglu={swiglu}); open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=_env(), cwd=_ROOT, check=True, timeout=600)
    sass = subprocess.run([_cuobjdump(), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
    code_lines = [(int(m.group(1), 16), m.group(2).strip())
                  for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = [(int(t.group(1), 16), a) for a, txt in code_lines
             if (t := re.search(r"BRA (0x[0-9a-f]+)", txt)) and int(t.group(1), 16) < a]
    loops = []
    for lo, hi in spans:
        body = [re.sub(r"^@!?U?P\w+\s+", "", t) for a, t in code_lines if lo <= a <= hi]
        loops.append((len(body), collections.Counter(b.split()[0] for b in body)))
    k_loops = [(n, ops) for n, ops in loops if any(o.startswith("HMMA") for o in ops)]
    n, ops = min(k_loops, key=lambda x: x[0])
    block_m, block_n, block_k, warps, _ = RING
    rows = block_n // warps // 8  # weight rows per thread
    assert ops["HMMA.16816.F32.BF16"] == (block_n // warps // 16) * (block_k // 16) * (block_m // 8)
    assert ops["LDGSTS.E.BYPASS.128"] == rows * (block_k // 128) and ops["LDGSTS.E.64"] == 1, ops
    assert ops["LDG.E.128"] == (block_m // 8) * (block_k // 32), ops  # activations only
    assert not any(o.startswith(("LDL", "STL")) for o in ops), ops
    assert n / (block_n * block_k // (32 * warps)) <= 5.0, (n, ops)


# ----------------------------------------------------------------------------- GPU


def _launch(x, w, out, offsets, config, **kw):
    from megamoe.kernels.gemm import nvfp4_mma_decode as mma

    return mma.launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                       config=config, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_cuda_ring_equals_registers_on_v4_shapes(stages, gemm):
    """V4-Flash expert shapes (gate_up 4096x4096 + SwiGLU with row gather, down 4096x2048), 16 experts with
    0..64 rows (the band's range, chunks of 32): the ring gives the register path's bits, and both match
    float32 math on the decoded weights."""
    device = torch.device("cuda")
    counts = [0, 1, 12, 22, 32, 33, 64, 7, 0, 17, 40, 3, 9, 12, 25, 2]
    e, t = len(counts), sum(counts) + 5  # 5 padding rows
    n, k = (4096, 4096) if gemm == "gate_up" else (4096, 2048)
    w = random_codes_weight((e, n, k), device, scale_shape=(e, 1, 1))
    offsets = offsets_of(counts, device)
    kw = {}
    if gemm == "gate_up":
        x = (torch.randn(300, k, device=device) * 0.05).bfloat16()
        kw = dict(row_index=torch.randint(0, 300, (t,), dtype=torch.int32, device=device), swiglu=True,
                  swiglu_limit=10.0)
        width = n // 2
    else:
        x = (torch.randn(t, k, device=device) * 0.05).bfloat16()
        width = n
    outs = []
    for config in (RING[:4], RING[:4] + (stages,)):
        out = torch.full((t, width), float("nan"), dtype=torch.bfloat16, device=device)
        _launch(x, w, out, offsets, config, **kw)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "ring differs from register double-buffering"
    real = sum(counts)
    assert (outs[1][real:] == 0).all()
    if gemm == "gate_up":
        ref = swiglu_reference(grouped_f32(x, w, offsets, kw["row_index"]), 10.0)
    else:
        ref = grouped_f32(x, w, offsets)
    assert rel_err(outs[1][:real], ref[:real]) < 1e-2


@pytest.mark.cuda
def test_cuda_ring_decode_is_exact():
    """Identity rows, global scale 1: the decoded weight bit for bit (every code, awkward scale bytes)."""
    # one expert of k = 512 rows: 16 chunks of 32 rows, each a full K loop through the ring
    assert_exact_decode(lambda x, w, out, offsets: _launch(x, w, out, offsets, RING), 128, 512, torch.device("cuda"))


@pytest.mark.cuda
def test_cuda_ring_swiglu_interleaved_small():
    """Small SwiGLU shape (N not a multiple of BLOCK_N) through the ring, against the float32 reference."""
    from gemm_helpers import random_weight

    device = torch.device("cuda")
    e, i, k = 3, 96, 512  # K % 256 == 0: 16-byte aligned scale rows, so the ring is used
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    counts = [9, 40, 0]
    t = sum(counts) + 1
    x = (torch.randn(t, k, device=device) * 20).bfloat16()
    out = torch.full((t, i), float("nan"), dtype=torch.bfloat16, device=device)
    _launch(x, interleave_gate_up(plain), out, offsets_of(counts, device), RING, swiglu=True, swiglu_limit=0.5)
    y = grouped_f32(x, plain, offsets_of(counts, "cpu"))
    inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
    assert rel_err(out[:49], swiglu_reference(inter, 0.5)[:49]) < 4e-3
    assert (out[49:] == 0).all()


@pytest.mark.cuda
def test_cuda_ring_falls_back_when_scale_rows_are_unaligned():
    """K = 384 (24 scale bytes per row): a ring config runs the register path, same bits, correct."""
    from gemm_helpers import random_weight

    device = torch.device("cuda")
    counts = [9, 40, 0, 2]
    w = random_weight((4, 136, 384), device, scale_shape=(4, 1, 1))
    x = torch.randn(sum(counts) + 1, 384, device=device).bfloat16()
    outs = [_launch(x, w, torch.empty(x.shape[0], 136, dtype=torch.bfloat16, device=device),
                    offsets_of(counts, device), cfg) for cfg in (RING[:4], RING)]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1][:51], grouped_f32(x, w, offsets_of(counts, "cpu"))[:51]) < 4e-3


@pytest.mark.cuda
def test_cuda_ring_sync_free_and_graph():
    """512-token-like routing (E = 64, ~12 rows per expert) on the down shape: no host sync, graph replay with
    new x and new routing written in place == eager."""
    device = torch.device("cuda")
    e, n, k = 64, 4096, 2048
    w = random_codes_weight((e, n, k), device, scale_shape=(e, 1, 1))
    t = 12 * e
    offsets = uniform_offsets(e, t, device)
    x = (torch.randn(t + 2, k, device=device) * 0.05).bfloat16()
    out = torch.full((t + 2, n), 3.0, dtype=torch.bfloat16, device=device)
    _launch(x, w, out, offsets, RING)
    assert rel_err(out[:t], grouped_f32(x, w, offsets)[:t]) < 1e-2
    check_sync_free_and_graph(lambda: _launch(x, w, out, offsets, RING), x, offsets, t)
    assert rel_err(out[:t], grouped_f32(x, w, offsets)[:t]) < 1e-2
