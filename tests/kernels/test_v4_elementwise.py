"""Fused V4 attention elementwise kernels (megamoe.kernels.v4_elementwise through megamoe.ops.v4_elementwise)
against the PyTorch formulas (the ops' ``*_reference`` functions, evaluated on the CPU).

Claims checked: bit-exact (bf16 bits, NaN positions) for RoPE, the FP8 / FP4 block simulations, the output
layout and the norms whenever the float32 sums are order-independent (designed inputs: few-bit values, eps = 0,
E4M3 / E2M1 rounding ties, saturation, amax floors); on general random inputs the only allowed differences are the
stated float32 summation-order effects (a tiny fraction of elements). CPU runs the interpreter; CUDA tests (skipped
here) run the kernels on the GPU, graph replay included, at V4-Flash shapes.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

from megamoe.ops import v4_elementwise as ew
from megamoe.reference import v4_numerics as nx
from sync_helpers import no_host_syncs

#: Allowed fraction of differing elements on general random inputs (summation order of the norms' sums of
#: squares and of the Hadamard; measured 0 on the interpreter, ~2e-7 expected for the FP4 query).
ORDER_FRACTION = 1e-3

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on inf/NaN inputs


def _table(rope_dim, n=64, yarn=True):
    if yarn:
        return nx.rope_frequencies(rope_dim, n, base=160000.0, original_seq_len=32, factor=16)
    return nx.rope_frequencies(rope_dim, n, base=10000.0)


def _compare(got, want, *, max_fraction=0.0, what=""):
    """bf16 tensors: NaN at the same places; elsewhere equal bits (signed zeros included) except for at most
    ``max_fraction`` of the elements."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn != wn).sum())} elements)"
    if got.dtype == torch.bfloat16:
        diff = (got.view(torch.int16) != want.view(torch.int16)) & ~gn
    else:
        diff = (got.view(torch.int32) != want.view(torch.int32)) & ~gn
    n = int(diff.sum())
    assert n <= max_fraction * got.numel(), f"{what}: {n} of {got.numel()} elements differ"


def _random_bf16(*shape, device="cpu"):
    """Normal values with per-element magnitudes spread over ~2**-12 .. 2**4."""
    x = torch.randn(*shape) * torch.rand(*shape).pow(4) * 10
    return x.to(torch.bfloat16).to(device)


def _few_bit(*shape, exponent=0, device="cpu"):
    """k * 2**(exponent - 3), k in -15..15: sums of squares are exact in float32 whatever the order."""
    k = torch.randint(-15, 16, shape).float()
    return (k * 2.0 ** (exponent - 3)).to(torch.bfloat16).to(device)


def _cpu(*ts):
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in ts]


# ------------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("N", [256, 1536])
def test_rms_norm(device, N):
    x = _random_bf16(5, N, device=device)
    w = (1 + 0.1 * torch.randn(N)).to(device)
    exact = device.type == "cpu"
    _compare(ew.rms_norm(x, w, 1e-6), nx.rms_norm(*_cpu(x, w), 1e-6), max_fraction=ORDER_FRACTION, what="random")
    # order-independent sums: bit-exact (GPU: up to rsqrt.approx vs the CPU's 1/sqrt)
    x = torch.cat([_few_bit(2, N, exponent=e) for e in (-20, 0, 12)]).to(device)
    x[0] = 0  # zero row: eps only
    x[1, :3] = torch.tensor([float("nan"), 1.0, 2.0])
    x[2, 5] = float("inf")
    x[3] = 3e19  # squares overflow to inf -> rsqrt 0 -> zeros
    _compare(ew.rms_norm(x, w, 1e-6), nx.rms_norm(*_cpu(x, w), 1e-6), max_fraction=0.0 if exact else 1e-3,
             what="few-bit")
    _compare(ew.rms_norm(x, None, 1e-6), nx.rms_norm(x.cpu(), None, 1e-6), max_fraction=0.0 if exact else 1e-3,
             what="no weight")


# ------------------------------------------------------------------------------------------------ q heads + kv
def _q_kv(q, kv, w, freqs, pos, H, eps):
    got_q, got_kv = ew.q_kv_path(q, kv, w, freqs, pos, num_heads=H, eps=eps)
    q, kv, w, freqs, pos = _cpu(q, kv, w, freqs, pos)
    want_q = None if q is None else ew.q_path_reference(q, freqs, pos, num_heads=H, eps=eps)
    want_kv = None if kv is None else ew.kv_path_reference(kv, w, freqs, pos, eps=eps)
    return got_q, want_q, got_kv, want_kv


@pytest.mark.parametrize("D,rope_dim,yarn", [(320, 64, True), (512, 64, False)])
def test_q_kv_random(device, D, rope_dim, yarn):
    T, H = 3, 3 if D == 320 else 2
    freqs = _table(rope_dim, yarn=yarn).to(device)
    pos = torch.tensor([0, 63, 17], dtype=torch.int64 if yarn else torch.int32, device=device)
    q = _random_bf16(T, H * D, device=device)
    q[1] *= 1e-30  # tiny head rows
    kv = _random_bf16(T, D, device=device)
    kv[2] *= 1e4
    w = (1 + 0.1 * torch.randn(D)).to(device)
    gq, wq, gkv, wkv = _q_kv(q, kv, w, freqs, pos, H, 1e-6)
    assert gq.shape == (T, H, D) and gkv.shape == (T, D)
    _compare(gq, wq, max_fraction=ORDER_FRACTION, what="q")
    _compare(gkv, wkv, max_fraction=ORDER_FRACTION, what="kv")


@pytest.mark.parametrize("H", [3, 10])  # fewer heads than one program's 8; a partial second program
def test_q_kv_several_heads_per_program(device, monkeypatch, H):
    """Prefill sizes run Q_KV_HEADS_PER_PROGRAM heads per program (forced here): the same per-head formula (the sum
    of squares reduced along the tile's rows: summation-order effects only), the kv row after the q programs, no
    write past the last head."""
    from megamoe.kernels import v4_elementwise as kew

    monkeypatch.setattr(kew, "Q_KV_MULTI_MIN_ROWS", 0)
    assert kew.q_kv_heads_per_program(1, H) == kew.Q_KV_HEADS_PER_PROGRAM
    T, D, rd = 3, 320, 64
    freqs = _table(rd).to(device)
    pos = torch.tensor([0, 63, 17], dtype=torch.int32, device=device)
    q = _random_bf16(T, H * D, device=device)
    kv = _random_bf16(T, D, device=device)
    w = (1 + 0.1 * torch.randn(D)).to(device)
    gq, wq, gkv, wkv = _q_kv(q, kv, w, freqs, pos, H, 1e-6)
    _compare(gq, wq, max_fraction=ORDER_FRACTION, what="q, several heads per program")
    _compare(gkv, wkv, max_fraction=ORDER_FRACTION, what="kv after the q programs")
    gq_only = ew.q_kv_path(q, None, None, freqs, pos, num_heads=H, eps=1e-6)[0]
    _compare(gq_only, wq, max_fraction=ORDER_FRACTION, what="q only")


def _e4m3_designed_weights(D, nope):
    """kv weights that, with |x| constant and eps = 0 (y = bf16(w)), put E4M3 ties, values rounding up to 448,
    subnormal codes and floored tiny blocks into the FP8 simulation."""
    ties = torch.tensor([1.0625, 13.0, 232.0, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 447.0, 440.0,
                         3.0 * 2.0 ** -10, 0.0, -0.0, -13.0, -1.0625, 100.0, 2.0 ** -12, 416.0, 2.0 ** -9,
                         3.5 * 2.0 ** -9])
    w = torch.empty(D)
    for b in range(nope // 64):
        blk = ties[torch.randint(0, len(ties), (64,))] * torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
        blk[0] = 440.0  # amax 440 * 2**e -> scale 2**e, the others sit on E4M3 grid midpoints
        e = [0, -7, 9, -30, -60][b % 5]
        w[b * 64:(b + 1) * 64] = blk * 2.0 ** e
    w[64:128] *= 2.0 ** -16  # amax 440 * 2**-23 ~ 5e-5: below the 1e-4 floor (block 4: ~4e-16, all codes 0)
    w[nope:] = torch.randn(D - nope)
    return w.to(torch.bfloat16).float()


def test_q_kv_exact_designed(device):
    """eps = 0 and |x| = 2**k per row: the norms are exact, so every output must equal the formula's bits."""
    T, H, D, rd = 4, 2, 512, 64
    freqs = _table(rd).to(device)
    pos = torch.tensor([0, 5, 40, 63], dtype=torch.int32, device=device)
    sign = torch.where(torch.rand(T, D) < 0.5, -1.0, 1.0)
    kv = (sign * 2.0 ** torch.tensor([0.0, -9.0, 7.0, -100.0])[:, None]).to(torch.bfloat16).to(device)
    w = _e4m3_designed_weights(D, D - rd).to(device)
    q = torch.cat([_few_bit(T, D, exponent=e) for e in (0, -40)], dim=1).to(device)  # exact head sums
    gq, wq, gkv, wkv = _q_kv(q, kv, w, freqs, pos, H, 0.0)
    exact = device.type == "cpu"
    _compare(gkv, wkv, max_fraction=0.0 if exact else 1e-3, what="kv designed")  # GPU: rsqrt.approx
    _compare(gq, wq, max_fraction=0.0 if exact else 1e-3, what="q few-bit")
    _, wq, _, _ = _q_kv(q, None, None, freqs, pos, H, 1e-6)
    _compare(ew.q_kv_path(q, None, None, freqs, pos, num_heads=H, eps=1e-6)[0], wq,
             max_fraction=0.0 if exact else 1e-3, what="q only, eps")
    # the designed kv really exercises the FP8 corner cases
    codes, scales = nx.fp8_block_encode(wkv[:, :D - rd], 64)
    u8 = codes.view(torch.uint8)
    assert ((u8 & 0x7F) == 0x7E).any() and ((u8 & 0x78) == 0).any() and ((u8 & 0x7F) == 1).any()
    assert (scales == nx.pow2_ceil(torch.tensor(1e-4 / 448))).any()


def test_q_kv_nonfinite_and_zeros(device):
    T, H, D, rd = 3, 2, 256, 64
    freqs = _table(rd).to(device)
    pos = torch.tensor([3, 0, 9], dtype=torch.int32, device=device)
    q = _random_bf16(T, H * D, device=device)
    kv = _random_bf16(T, D, device=device)
    q[0, 7] = float("nan")
    q[1, D + 200] = float("inf")   # head 1, a RoPE dim
    q[2, :D] = 0                   # zero head
    kv[0, 70] = float("inf")       # FP8 block 1 -> NaN (and the norm makes the row NaN/0)
    kv[1] = 0
    kv[2, 250] = float("nan")      # RoPE dim
    w = (1 + 0.1 * torch.randn(D)).to(device)
    gq, wq, gkv, wkv = _q_kv(q, kv, w, freqs, pos, H, 1e-6)
    _compare(gq, wq, max_fraction=ORDER_FRACTION, what="q")
    _compare(gkv, wkv, max_fraction=ORDER_FRACTION, what="kv")
    assert torch.isnan(gkv[2]).all() and (gkv[1].float() == 0).all()
    _, gkv_only = ew.q_kv_path(None, kv, w, freqs, pos, num_heads=H, eps=1e-6)
    _compare(gkv_only, wkv, max_fraction=ORDER_FRACTION, what="kv only")


# ------------------------------------------------------------------------------------------------ indexer query
def _index(q, iw, freqs, pos, NH, scale):
    got = ew.index_q_path(q, iw, freqs, pos, n_heads=NH, weight_scale=scale)
    want = ew.index_q_reference(*_cpu(q, iw, freqs, pos), n_heads=NH, weight_scale=scale)
    return got, want


def test_index_q_random(device):
    T, NH, Di, rd = 3, 12, 128, 64  # 12 heads: a partial head block
    freqs = _table(rd).to(device)
    pos = torch.tensor([1, 62, 30], dtype=torch.int32, device=device)
    q = _random_bf16(T, NH * Di, device=device)
    q[1] *= 2.0 ** -100
    q[2] *= 2.0 ** 60
    iw = _random_bf16(T, NH, device=device)
    scale = Di ** -0.5 * NH ** -0.5
    (gq, gw), (wq, ww) = _index(q, iw, freqs, pos, NH, scale)
    assert gq.shape == (T, NH, Di) and gw.dtype == torch.float32
    _compare(gq, wq, max_fraction=ORDER_FRACTION, what="index q")
    _compare(gw, ww, what="weights")


def test_index_q_fp4_ties_exact(device):
    """Di = 64 (the Hadamard scale 1/8 is exact) and few-hot rows: every Hadamard output is exact and lands on
    E2M1 rounding midpoints (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) times the block scale; NaN/Inf blocks, zeros."""
    T, NH, Di, rd = 2, 9, 64, 32
    freqs = _table(rd).to(device)
    pos = torch.tensor([7, 0], dtype=torch.int32, device=device)
    mids8 = [2, 6, 10, 14, 20, 28, 40]  # midpoints * 8
    q = torch.zeros(T, NH, Di)
    for t in range(T):
        for h in range(NH):
            s = torch.tensor([48, 40, 20, mids8[int(torch.randint(0, 7, ()))]], dtype=torch.float32)
            s = s[torch.randperm(4)] * torch.where(torch.rand(4) < 0.5, -1.0, 1.0)
            h4 = nx.hadamard_matrix(4)
            q[t, h, :4] = (h4 @ s) / 4 * 2.0 ** int(torch.randint(-20, 20, ()))  # x = H4 s / 4 -> y = s / 8
    q[0, 1, :] = 0                     # zero head
    q[1, 2, 3] = float("nan")          # every block NaN
    q[1, 3, 10] = float("inf")         # inf in every output -> NaN blocks
    q = q.reshape(T, NH * Di).to(torch.bfloat16).to(device)
    iw = _random_bf16(T, NH, device=device)
    (gq, gw), (wq, ww) = _index(q, iw, freqs, pos, NH, 0.1)
    _compare(gq, wq, what="index q ties")
    _compare(gw, ww, what="weights")
    y = nx.hadamard_rotate(nx.apply_rope(q.cpu().view(T, NH, Di), freqs.cpu()[pos.cpu().long()]))
    codes, scales = nx.fp4_block_encode(y[0, 0].float(), 32)
    ratio = y[0, 0].float().abs() / scales.repeat_interleave(32)
    assert (ratio == 5).any() and (ratio == 2.5).any()            # exact ties in the input of the E2M1 rounding
    assert ((codes & 7)[ratio == 5] == 6).all() and ((codes & 7)[ratio == 2.5] == 4).all()  # -> 4 and 2 (even)


# ------------------------------------------------------------------------------------------------ output
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_output_grouped_layout(device, groups):
    T, H, D, rd = 3, 4, 320, 64
    freqs = _table(rd, yarn=False).to(device)
    pos = torch.tensor([2, 0, 63], dtype=torch.int64, device=device)
    o = _random_bf16(T, H, D, device=device)
    o[0, 1, 300] = float("nan")
    o[1, 2, 3] = float("inf")
    o[2, 3, 301] = -0.0
    got = ew.output_path(o, freqs, pos, groups=groups)
    assert got.shape == (groups, T, H * D // groups) and got.is_contiguous()
    want = ew.output_reference(*_cpu(o, freqs, pos), groups=groups)
    _compare(got, want, what="output")
    # prefill sizes: several heads per program (forced), the same bits (no reductions)
    from megamoe.kernels import v4_elementwise as kew

    saved = kew.Q_KV_MULTI_MIN_ROWS
    kew.Q_KV_MULTI_MIN_ROWS = 0
    try:
        multi = ew.output_path(o, freqs, pos, groups=groups)
    finally:
        kew.Q_KV_MULTI_MIN_ROWS = saved
    assert torch.equal(multi.view(torch.int16), got.view(torch.int16))


# ------------------------------------------------------------------------------------------------ validation
def test_validation_errors():
    f = _table(64)
    pos = torch.zeros(2, dtype=torch.int32)
    q = torch.zeros(2, 2 * 128, dtype=torch.bfloat16)
    kv = torch.zeros(2, 128, dtype=torch.bfloat16)
    w = torch.ones(128)
    with pytest.raises(TypeError, match="q: expected dtype"):
        ew.q_kv_path(q.float(), kv, w, f, pos, num_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="num_heads"):
        ew.q_kv_path(q, kv, w, f, pos, num_heads=3, eps=1e-6)
    with pytest.raises(ValueError, match="kv_weight"):
        ew.q_kv_path(q, kv, torch.ones(64), f, pos, num_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="FP8 block"):
        ew.q_kv_path(None, torch.zeros(2, 96, dtype=torch.bfloat16), torch.ones(96), _table(64), pos,
                     num_heads=1, eps=1e-6)
    with pytest.raises(TypeError, match="freqs"):
        ew.q_kv_path(q, kv, w, torch.view_as_real(f), pos, num_heads=2, eps=1e-6)
    with pytest.raises(TypeError, match="positions"):
        ew.q_kv_path(q, kv, w, f, pos.float(), num_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="positions"):
        ew.q_kv_path(q, kv, w, f, pos[:1], num_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="at least one"):
        ew.q_kv_path(None, None, None, f, pos, num_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        ew.index_q_path(torch.zeros(2, 2 * 96, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16), f,
                        pos, n_heads=2, weight_scale=1.0)
    with pytest.raises(ValueError, match="weights"):
        ew.index_q_path(torch.zeros(2, 2 * 64, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16), f,
                        pos, n_heads=2, weight_scale=1.0)
    with pytest.raises(ValueError, match="groups"):
        ew.output_path(torch.zeros(2, 3, 128, dtype=torch.bfloat16), f, pos, groups=2)
    with pytest.raises(ValueError, match="rope_dim"):
        ew.output_path(torch.zeros(2, 2, 32, dtype=torch.bfloat16), f, pos, groups=1)
    with pytest.raises(ValueError, match="weight"):
        ew.rms_norm(kv, torch.ones(64), 1e-6)


# ------------------------------------------------------------------------------------------------ sm_90 build
_BUILD = r"""
import json, sys
from megamoe.kernels.v4_elementwise import compile_sm90
family = sys.argv[1]
multi = family.endswith("_multi")
c = compile_sm90(family[:-6], q_heads_per_program=8) if multi else compile_sm90(family)
open(sys.argv[2] + ".cubin", "wb").write(c.asm["cubin"])
open(sys.argv[2] + ".ptx", "w").write(c.asm["ptx"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["rms_norm", "q_kv", "q_kv_multi", "index_q", "output", "output_multi"])
def test_sm90_compile_no_spills_no_fma(family, tmp_path):
    """V4-Flash shapes build for sm_90 offline: no local memory (spills), a tiny stack, few registers, and no
    FMA contraction in the PTX (the reference rounds each product)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("cuobjdump not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = str(tmp_path / family)
    subprocess.run([sys.executable, "-c", _BUILD, family, out], env=env, cwd=root, check=True, timeout=600)
    usage = subprocess.run([tool, "-res-usage", out + ".cubin"], capture_output=True, text=True, check=True).stdout
    res = {k: int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "LOCAL", "STACK")}
    assert res["LOCAL"] == 0 and res["STACK"] <= 16 and res["REG"] <= 64, res
    ptx = open(out + ".ptx").read()
    assert "fma.rn.f32" not in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx  # divisions by the scales are div.rn


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
def test_cuda_v4_flash_shapes_graph_replay_sync_free():
    """V4-Flash shapes (B = 4 decode rows): each op once eager under sync-debug "error", then captured and
    replayed on new inputs; replay == eager == the CPU formulas (within the stated tolerances)."""
    dev = torch.device("cuda")
    B, H, D, rd, NH, Di, G, Q = 4, 64, 512, 64, 64, 128, 8, 1024
    freqs = _table(rd, n=4096).to(dev)
    pos = torch.tensor([0, 100, 4095, 7], dtype=torch.int32, device=dev)
    ins = dict(x=_random_bf16(B, Q, device=dev), q=_random_bf16(B, H * D, device=dev),
               kv=_random_bf16(B, D, device=dev), iq=_random_bf16(B, NH * Di, device=dev),
               iw=_random_bf16(B, NH, device=dev), o=_random_bf16(B, H, D, device=dev))
    wq, wkv = (1 + 0.1 * torch.randn(Q)).to(dev), (1 + 0.1 * torch.randn(D)).to(dev)

    def run():
        return (ew.rms_norm(ins["x"], wq, 1e-6),
                *ew.q_kv_path(ins["q"], ins["kv"], wkv, freqs, pos, num_heads=H, eps=1e-6),
                *ew.index_q_path(ins["iq"], ins["iw"], freqs, pos, n_heads=NH, weight_scale=Di ** -0.5 * NH ** -0.5),
                ew.output_path(ins["o"], freqs, pos, groups=G))

    run()
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = [t.clone() for t in run()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for k, v in ins.items():
        v.copy_(_random_bf16(*v.shape, device=dev))
    graph.replay()
    torch.cuda.synchronize()
    fresh = run()
    for a, b in zip(outs, fresh):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert not all(torch.equal(a, b) for a, b in zip(eager, fresh) if not a.isnan().any())
    c = {k: v.cpu() for k, v in ins.items()}
    fc, pc = freqs.cpu(), pos.cpu()
    want = (nx.rms_norm(c["x"], wq.cpu(), 1e-6),
            ew.q_path_reference(c["q"], fc, pc, num_heads=H, eps=1e-6),
            ew.kv_path_reference(c["kv"], wkv.cpu(), fc, pc, eps=1e-6),
            *ew.index_q_reference(c["iq"], c["iw"], fc, pc, n_heads=NH, weight_scale=Di ** -0.5 * NH ** -0.5),
            ew.output_reference(c["o"], fc, pc, groups=G))
    # rsqrt.approx on the GPU vs the CPU's 1/sqrt: the norms may move an element by one bf16 ulp at a boundary
    for name, got, ref, frac in zip(("rms_norm", "q", "kv", "index_q", "index_w", "output"), fresh, want,
                                    (1e-3, 1e-3, 1e-2, ORDER_FRACTION, 0.0, 0.0)):
        _compare(got, ref, max_fraction=frac, what=name)


@pytest.mark.cuda
def test_cuda_exact_designed_inputs_match_cuda_formulas():
    """Against the formulas run on CUDA (same rsqrt instruction): the designed exact-norm kv and the ties of
    the FP4 query must match bit for bit; RoPE'd elements may differ only where PyTorch's CUDA complex multiply
    was FMA-contracted (one bf16 ulp at a boundary), so a small fraction is allowed there."""
    dev = torch.device("cuda")
    T, D, rd = 4, 512, 64
    freqs = _table(rd).to(dev)
    pos = torch.tensor([0, 5, 40, 63], dtype=torch.int32, device=dev)
    sign = torch.where(torch.rand(T, D) < 0.5, -1.0, 1.0)
    kv = (sign * 2.0 ** torch.tensor([0.0, -9.0, 7.0, -100.0])[:, None]).to(torch.bfloat16).to(dev)
    w = _e4m3_designed_weights(D, D - rd).to(dev)
    _, got = ew.q_kv_path(None, kv, w, freqs, pos, num_heads=1, eps=0.0)
    want = ew.kv_path_reference(kv, w, freqs, pos, eps=0.0)
    _compare(got[:, :D - rd], want[:, :D - rd], what="kv FP8 dims")
    _compare(got[:, D - rd:], want[:, D - rd:], max_fraction=0.05, what="kv RoPE dims")
