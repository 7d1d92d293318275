"""Decode-step glue kernels against their PyTorch formulas.

* ``ops.window_step`` (megamoe/kernels/attention_glue.py): SWA append + window ring rows + entry counts + HCA entry
  list, bit-identical to ``window_step_reference`` (integer math), edge rows included: inactive rows, slots out of
  range (both signs), negative positions, batch 1 and odd batches;
* ``ops.compressor_step(..., ape=)``: the kernel's in-kernel ``score + ape[pos mod m]`` equals the step on
  ``score + ape[...]`` computed in PyTorch (same state, pooled and flush bits);
* ``ew.post_pool`` (megamoe/kernels/v4_elementwise.py): the post-pool formula (bit-exact on few-bit inputs, where
  the float32 sums are order-independent; a small fraction of one-ulp differences on random inputs).
CPU runs the interpreter; the CUDA tests (graph replay == eager, sync-free) run at V4-Flash dims.
"""
import pytest
import torch

from megamoe.kvcache import ops
from megamoe.kvcache.state import CompressorState
from megamoe.ops import v4_elementwise as ew
from megamoe.reference import v4_numerics as nx
from sync_helpers import no_host_syncs

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # int32 wrap-around in the interpreter


def _batch(B, S, max_pos, device):
    slots = torch.randint(-2, S + 2, (B,), dtype=torch.int32)
    positions = torch.randint(-3, max_pos, (B,), dtype=torch.int32)
    active = torch.rand(B) < 0.7
    return slots.to(device), positions.to(device), active.to(device)


def _window_case(B, S, W, D, ratio, n_ent, device):
    swa = torch.randn(S * W + 1, D).to(torch.bfloat16).to(device)
    kv = torch.randn(B, D).to(torch.bfloat16).to(device)
    slots, positions, active = _batch(B, S, 5 * W, device)
    outs = {}
    for name in ("got", "want"):
        outs[name] = dict(swa=swa.clone(), rows=torch.full((B, W), 7, dtype=torch.int32, device=device),
                          n=torch.full((B,), 7, dtype=torch.int32, device=device) if ratio else None,
                          ent=torch.full((B, n_ent), 7, dtype=torch.int32, device=device) if n_ent else None)
    g, w = outs["got"], outs["want"]
    ops.window_step(g["swa"], W, kv, slots, positions, active, g["rows"], ratio=ratio, n_entries=g["n"],
                    entry_idx=g["ent"])
    ops.window_step_reference(w["swa"], W, kv, slots, positions, active, w["rows"], ratio=ratio,
                              n_entries=w["n"], entry_idx=w["ent"])
    # the scratch row holds one of the invalid rows' kv (which one is unspecified when several are invalid)
    assert torch.equal(g["swa"][:-1].view(torch.int16), w["swa"][:-1].view(torch.int16))
    ok = active & (slots >= 0) & (slots < S) & (positions >= 0)
    if int((~ok).sum()) == 1:
        assert torch.equal(g["swa"][-1].view(torch.int16), w["swa"][-1].view(torch.int16))
    assert torch.equal(g["rows"], w["rows"])
    if ratio:
        assert torch.equal(g["n"], w["n"])
    if n_ent:
        assert torch.equal(g["ent"], w["ent"])
    return slots, positions, active


@pytest.mark.parametrize("B,S,W,D,ratio,n_ent", [
    (1, 2, 8, 64, 0, 0),        # window-only layer, batch 1
    (2, 1, 8, 64, 4, 0),        # one slot (a model of max_batch 1: Triton specialized num_slots = 1 and the GPU
                                # build failed)
    (5, 3, 8, 144, 4, 0),       # CSA: counts, no list
    (7, 4, 16, 128, 16, 9),     # HCA: odd batch, entry list
    (3, 2, 8, 64, 128, 1),      # HCA: ratio > window
])
def test_window_step_matches_formula(device, B, S, W, D, ratio, n_ent):
    for _ in range(3):
        _window_case(B, S, W, D, ratio, n_ent, device)


def test_window_step_edge_rows(device):
    """Designed rows: inactive, slot -1 / S / huge, position -1 / -W-1 / 0 / huge, every output checked."""
    S, W, D = 3, 8, 64
    slots = torch.tensor([0, -1, 3, 2, 1, 2, 2 ** 30, 0], dtype=torch.int32, device=device)
    positions = torch.tensor([0, 5, 5, -1, -9, 2 ** 31 - 2, 3, 40], dtype=torch.int32, device=device)
    active = torch.tensor([True, True, True, True, True, True, True, False], device=device)
    kv = torch.randn(8, D).to(torch.bfloat16).to(device)
    res = []
    for fn in (ops.window_step, ops.window_step_reference):
        swa = torch.zeros(S * W + 1, D, dtype=torch.bfloat16, device=device)
        rows = torch.zeros(8, W, dtype=torch.int32, device=device)
        n = torch.zeros(8, dtype=torch.int32, device=device)
        ent = torch.zeros(8, 11, dtype=torch.int32, device=device)
        fn(swa, W, kv, slots, positions, active, rows, ratio=4, n_entries=n, entry_idx=ent)
        res.append((swa[:-1], rows, n, ent))
    for got, want in zip(*res):
        assert torch.equal(got.view(torch.int32) if got.dtype == torch.int32 else got.view(torch.int16),
                           want.view(torch.int32) if want.dtype == torch.int32 else want.view(torch.int16))
    swa, rows, n, ent = res[0]
    assert torch.equal(swa[0].view(torch.int16), kv[0].view(torch.int16))   # slot 0, pos 0 -> ring row 0
    assert rows[0, 0] == 0 and (rows[0, 1:] == -1).all()
    assert (rows[4] == -1).all()                                              # pos -9: no window positions
    assert n.tolist()[3:5] == [0, -2] and n[7] == 0                           # floor(0/4)=0, floor(-8/4)=-2, inactive


def test_window_step_validation():
    swa = torch.zeros(17, 8, dtype=torch.bfloat16)
    kv = torch.zeros(2, 8, dtype=torch.bfloat16)
    s = torch.zeros(2, dtype=torch.int32)
    a = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="n_entries"):
        ops.window_step(swa, 8, kv, s, s, a, ratio=4)
    with pytest.raises(ValueError, match="window_rows"):
        ops.window_step(swa, 8, kv, s, s, a, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="swa_rows"):
        ops.window_step(swa, 5, kv, s, s, a)
    with pytest.raises(TypeError, match="kv"):
        ops.window_step(swa, 8, kv.float(), s, s, a)


@pytest.mark.parametrize("ratio,overlap,width,B", [(4, True, 64, 3), (8, False, 48, 1), (4, True, 32, 4)])
def test_compressor_step_ape_in_kernel(device, ratio, overlap, width, B):
    """Kernel with ape == kernel fed ``score + ape[pos mod m]`` (the layer's formula), several steps, flushes."""
    S = 3
    C = 2 if overlap else 1
    states = [CompressorState.allocate(S, ratio, width, overlap, device) for _ in range(2)]
    ape = torch.randn(ratio, C * width).to(device)
    slots = torch.tensor([(b * 2 + 1) % (S + 1) - (1 if b == 2 else 0) for b in range(B)], dtype=torch.int32)
    pos = torch.randint(0, 3, (B,), dtype=torch.int32)
    pos[-1] = -1 if B > 2 else pos[-1]
    for step in range(2 * ratio + 1):
        kv = torch.randn(B, C * width).to(device)
        score = torch.randn(B, C * width).to(device)
        active = (torch.rand(B) < 0.8).to(device)
        p = (pos + step).to(device)
        s = slots.to(device)
        outs = []
        for i, st in enumerate(states):
            pooled = torch.zeros(B, width, device=device)
            flush = torch.zeros(B, dtype=torch.bool, device=device)
            if i == 0:
                ops.compressor_step(st, kv, score, s, p, active, pooled, flush, ape=ape)
            else:
                ops.compressor_step(st, kv, score + ape[torch.remainder(p.long(), ratio)], s, p, active, pooled,
                                    flush)
            outs.append((pooled, flush))
        assert torch.equal(outs[0][1], outs[1][1])
        assert torch.equal(outs[0][0].view(torch.int32), outs[1][0].view(torch.int32))
        for name in ("tail_k", "tail_z", "tail_kb", "tail_zb", "tail_len"):
            a, b = getattr(states[0], name), getattr(states[1], name)
            if a is not None:
                assert torch.equal(a, b), name


def _few_bit(*shape):
    k = torch.randint(-15, 16, shape).float()
    return k * 2.0 ** -3


def _compare_bf16(got, want, max_fraction):
    got, want = got.cpu(), want.cpu()
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn)
    n = int(((got.view(torch.int16) != want.view(torch.int16)) & ~gn).sum())
    assert n <= max_fraction * got.numel(), f"{n} of {got.numel()} elements differ"


@pytest.mark.parametrize("D,rope,rotate,ratio", [(144, 16, False, 4), (128, 64, False, 16), (64, 16, True, 4)])
def test_post_pool_matches_formula(device, D, rope, rotate, ratio):
    n_pos = 40
    freqs = nx.rope_frequencies(rope, n_pos, base=160000.0, original_seq_len=16, factor=4).to(device)
    w = (1 + 0.1 * torch.randn(D)).to(device)
    N = 6
    positions = torch.tensor([-5, 0, 3, ratio - 1, 39, 1000], dtype=torch.int32, device=device)  # clamped rows
    shift = 1 - ratio
    # few-bit inputs: every float32 sum is exact (any order), so the kernel equals the formula bit for bit
    pooled = _few_bit(N, D).to(device)
    pooled[1] = 0.0
    out = torch.empty(N, D, dtype=torch.bfloat16, device=device)
    want = ew.post_pool_reference(pooled.cpu(), w.cpu(), freqs.cpu(), positions.cpu(), shift=shift, eps=0.0 + 1e-6,
                                  rotate=rotate)
    got = ew.post_pool(pooled, w, freqs, positions, out, shift=shift, eps=1e-6, rotate=rotate)
    assert got is out
    _compare_bf16(got, want, 0.0 if (device.type == "cpu" and not rotate) else 0.02)
    # random inputs: only float32 summation-order effects (one bf16 ulp at rounding boundaries)
    pooled = (torch.randn(N, D) * 3).to(device)
    got = ew.post_pool(pooled, w, freqs, positions, out, shift=shift, eps=1e-6, rotate=rotate)
    want = ew.post_pool_reference(pooled.cpu(), w.cpu(), freqs.cpu(), positions.cpu(), shift=shift, eps=1e-6,
                                  rotate=rotate)
    _compare_bf16(got, want, 0.02)
    assert (got.float().cpu() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()


def test_post_pool_equals_cache_formula():
    """The op's reference is the cache's CPU formula (``_post_pool_rows`` on clamped window-start rows)."""
    from megamoe.kvcache import CompressedCacheConfig, CompressedKVCache

    cfg = CompressedCacheConfig(kind="csa", ratio=4, head_dim=144, rope_dim=16, index_head_dim=64, index_n_heads=4,
                                index_topk=8, window_size=8, entries_per_block=4, max_slots=2, max_context=64)
    cache = CompressedKVCache(cfg, "cpu", batch=3)
    freqs = nx.rope_frequencies(16, 64, base=160000.0, original_seq_len=16, factor=4)
    cache.set_post_pool(torch.randn(144), freqs, torch.randn(64))
    positions = torch.tensor([2, 7, 63], dtype=torch.int32)
    for index, D in ((False, 144), (True, 64)):
        pooled = torch.randn(3, D)
        start = (positions.long() - 3).clamp(0, 63)
        want = cache._post_pool_rows(pooled, freqs[start], index=index)
        got = ew.post_pool_reference(pooled, cache.post_pool["index_norm" if index else "norm"], freqs, positions,
                                     shift=-3, eps=cfg.norm_eps, rotate=index)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_sm90_compile_no_spills(tmp_path):
    """The new kernels compile for sm_90 at V4-Flash dims (subprocess: the interpreter must be off)."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests/kvcache')\n"
        "from kvcache_sm90_compile import ptxas_usage\n"
        "from megamoe.kernels import attention_glue as g, v4_elementwise as e\n"
        "r = {}\n"
        "for n, k in (('window_step_hca', g.compile_sm90()), ('window_step_csa', g.compile_sm90(ratio=4, entries=0)),\n"
        "             ('post_pool', e.compile_sm90('post_pool')), "
        "('post_pool_index', e.compile_sm90('post_pool_index'))):\n"
        "    u = ptxas_usage(k)\n"
        "    r[n] = dict(regs=u['regs'], spills=u['spill_bytes'], fma='fma.rn.f32' in k.asm['ptx'])\n"
        "print(json.dumps(r))\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        assert r["spills"] == 0 and r["regs"] <= 255, (name, r)
    assert not report["post_pool"]["fma"] and not report["post_pool_index"]["fma"]


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
def test_cuda_window_step_post_pool_v4_flash_graph_replay_sync_free():
    dev = torch.device("cuda")
    S, W, D, B, E = 64, 128, 512, 64, 8192
    swa = torch.randn(S * W + 1, D, device=dev).to(torch.bfloat16)
    kv = torch.randn(B, D, device=dev).to(torch.bfloat16)
    slots, positions, active = _batch(B, S, 1 << 20, dev)
    rows = torch.empty(B, W, dtype=torch.int32, device=dev)
    n = torch.empty(B, dtype=torch.int32, device=dev)
    ent = torch.empty(B, E, dtype=torch.int32, device=dev)
    freqs = nx.rope_frequencies(64, 1 << 20, base=160000.0, original_seq_len=65536, factor=16).to(dev)
    w = torch.randn(D, device=dev)
    wi = torch.randn(128, device=dev)
    pooled = torch.randn(B, D, device=dev)
    pooled_i = torch.randn(B, 128, device=dev)
    out, out_i = torch.empty(B, D, dtype=torch.bfloat16, device=dev), torch.empty(B, 128, dtype=torch.bfloat16,
                                                                                 device=dev)

    def step(sw):
        ops.window_step(sw, W, kv, slots, positions, active, rows, ratio=128, n_entries=n, entry_idx=ent)
        ew.post_pool(pooled, w, freqs, positions, out, shift=-127, eps=1e-6, rotate=False)
        ew.post_pool(pooled_i, wi, freqs, positions, out_i, shift=-3, eps=1e-6, rotate=True)

    eager_swa = swa.clone()
    step(eager_swa)  # warm-up / compile
    torch.cuda.synchronize()
    eager_swa = swa.clone()
    with no_host_syncs():
        step(eager_swa)
    eager = [t.clone() for t in (rows, n, ent, out, out_i)]
    # against the formulas
    want = dict(swa=swa.clone(), rows=torch.empty_like(rows), n=torch.empty_like(n), ent=torch.empty_like(ent))
    ops.window_step_reference(want["swa"], W, kv, slots, positions, active, want["rows"], ratio=128,
                              n_entries=want["n"], entry_idx=want["ent"])
    assert torch.equal(eager_swa[:-1], want["swa"][:-1])
    assert (torch.equal(eager[0], want["rows"]) and torch.equal(eager[1], want["n"])
            and torch.equal(eager[2], want["ent"]))
    _compare_bf16(eager[3], ew.post_pool_reference(pooled.cpu(), w.cpu(), freqs.cpu(), positions.cpu(), shift=-127,
                                                   eps=1e-6, rotate=False), 0.02)
    # graph replay == eager
    graph_swa = swa.clone()
    for t in (rows, n, ent, out, out_i):
        t.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_swa)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_swa[:-1], eager_swa[:-1])
    for a, b in zip((rows, n, ent, out, out_i), eager):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_compressor_ape_graph_replay_v4_flash():
    dev = torch.device("cuda")
    B, S, m, width = 64, 64, 4, 512
    st = [CompressorState.allocate(S, m, width, True, dev) for _ in range(2)]
    ape = torch.randn(m, 2 * width, device=dev)
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    pos = torch.randint(0, 1000, (B,), dtype=torch.int32, device=dev)
    active = torch.rand(B, device=dev) < 0.9
    kv, score = torch.randn(B, 2 * width, device=dev), torch.randn(B, 2 * width, device=dev)
    pooled = [torch.zeros(B, width, device=dev) for _ in range(2)]
    flush = [torch.zeros(B, dtype=torch.bool, device=dev) for _ in range(2)]
    ops.compressor_step(st[1], kv, score + ape[torch.remainder(pos.long(), m)], slots, pos, active, pooled[1],
                        flush[1])
    graph = torch.cuda.CUDAGraph()
    ops.compressor_step(st[0].clone(), kv, score, slots, pos, active, pooled[0].clone(), flush[0].clone(), ape=ape)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        ops.compressor_step(st[0], kv, score, slots, pos, active, pooled[0], flush[0], ape=ape)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(flush[0], flush[1]) and torch.equal(pooled[0], pooled[1])
    assert torch.equal(st[0].tail_z, st[1].tail_z) and torch.equal(st[0].tail_zb, st[1].tail_zb)
