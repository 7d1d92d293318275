"""CPU checks of benchmarks/bench_peer.py's pure-torch parts (the peer itself only runs on a GPU).

* the peer's routing metadata built in torch for k = 6 (its ``topk`` needs a power-of-2 k) agrees with our
  dispatch: counts, gather (sorted row -> pair) and scatter (pair -> sorted row) indices, gammas, and a dense
  emulation of the peer's gather / per-expert GEMM / gammas / scatter-sum semantics equals the direct top-k sum;
* the expert-chunked stacking of the peer's Hopper-swizzled weights equals one whole ``convert_layout``;
* our side of the benchmark (precomputed-dispatch and dispatch variants, the bf16 baseline on de-interleaved
  weights) equals the float32 reference the benchmark checks against.
"""
import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench_peer = importlib.import_module("bench_peer")

from megamoe.models.config import MoEConfig  # noqa: E402
from megamoe.ops import moe as moe_ops  # noqa: E402
from guard_helpers import set_interpret  # noqa: E402 (tests/guard_helpers.py: tests/ is on sys.path)


def _routing(kind, t, e, k, seed):
    return bench_peer.routing(kind, t, e, k, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["uniform", "zipf", "all-on-k"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_peer_routing_matches_our_dispatch(kind, tokens):
    e, k = 16, 6
    weights, ids = _routing(kind, tokens, e, k, seed=tokens)
    r = bench_peer.peer_routing(ids, weights, e)
    d = moe_ops.dispatch(ids, e)
    assert r["hist"].dtype == torch.int32 and r["gather_src"].dtype == torch.int32
    assert torch.equal(r["hist"], torch.bincount(ids.flatten().long(), minlength=e).int())
    assert torch.equal(r["slice_offs"][1:], d["expert_offsets"])  # our offsets are the cumulative row ends
    assert r["slice_offs"][0] == 0
    assert torch.equal(r["gather_src"] // k, d["row_index"])  # token of each sorted row (stable, same order)
    assert torch.equal(r["gather_dst"], d["inv_perm"])  # sorted row of pair t*k + j
    n = tokens * k
    assert torch.equal(r["gather_src"].long()[r["gather_dst"].long()], torch.arange(n))  # inverse permutations
    assert torch.equal(r["gate_scal"][d["inv_perm"].long()].view(tokens, k), weights)
    sorted_expert = ids.flatten().long()[r["gather_src"].long()]
    assert torch.equal(sorted_expert, d["sorted_expert"].long())


def test_peer_routing_emulation_equals_topk_sum():
    """The peer's semantics (matmul_ogs: rows [offs[e], offs[e+1]) read x[GatherIndx.src // k], are scaled by
    gammas, land on pair ScatterIndx.dst, then the k pairs of a token are summed) reproduce sum_j w_j x W_{id_j}."""
    e, k, t, h, n = 12, 6, 9, 8, 5
    weights, ids = _routing("zipf", t, e, k, seed=3)
    x = torch.randn(t, h, dtype=torch.float64)
    w = torch.randn(e, h, n, dtype=torch.float64)
    r = bench_peer.peer_routing(ids, weights, e)
    gi_src, si_src, si_dst = r["gather_src"].long(), r["gather_dst"].long(), r["gather_src"].long()
    y = torch.zeros(t * k, n, dtype=torch.float64)  # the down GEMM's scratch, one row per pair
    offs = r["slice_offs"].tolist()
    for ex in range(e):
        lo, hi = offs[ex], offs[ex + 1]
        rows = x[gi_src[lo:hi] // k] @ w[ex]
        y[si_dst[lo:hi]] = rows * r["gate_scal"][lo:hi, None].double()
    assert bool((si_src >= 0).all())  # no masked pair: the reduce keeps all k
    got = y.view(t, k, n).sum(1)
    want = torch.einsum("tj,tjn->tn", weights.double(), torch.einsum("th,tjhn->tjn", x, w[ids.long()]))
    torch.testing.assert_close(got, want)
    # deliberately wrong convention (scatter by the gather array's inverse): must differ
    bad = torch.zeros_like(y)
    for ex in range(e):
        lo, hi = offs[ex], offs[ex + 1]
        bad[si_src[lo:hi]] = (x[gi_src[lo:hi] // k] @ w[ex]) * r["gate_scal"][lo:hi, None].double()
    assert not torch.allclose(bad.view(t, k, n).sum(1), want)


def _peer_or_skip():
    tk, why = bench_peer.load_peer()
    if tk is None:
        pytest.skip(f"peer triton_kernels not importable: {why}")
    return tk


def test_peer_ragged_metadata_torch_agrees():
    tk = _peer_or_skip()
    weights, ids = _routing("zipf", 50, 20, 6, seed=1)
    r = bench_peer.peer_routing(ids, weights, 20)
    meta = tk.make_ragged_tensor_metadata_torch(r["hist"], ids.numel())
    assert torch.equal(meta.slice_offs, r["slice_offs"])
    for i, bs in enumerate(type(meta).block_sizes()):
        tiles = (r["hist"] + bs - 1) // bs
        assert int(meta.block_offs_data[i, -1]) == int(tiles.sum())


@pytest.mark.parametrize("chunk", [1, 3])
def test_peer_chunked_layout_equals_whole(chunk):
    """Stacking expert chunks converted one at a time == converting all experts at once (data and strides)."""
    tk = _peer_or_skip()
    e, k, n = 4, 128, 256
    gen = torch.Generator().manual_seed(0)
    quant = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen).transpose(1, 2)
    scale = torch.randint(100, 140, (e, n, k // 32), dtype=torch.uint8, generator=gen).transpose(1, 2)
    w_all, s_all = bench_peer.peer_swizzle(tk, quant, scale)
    chunks = ((a, quant[a:a + chunk], scale[a:a + chunk]) for a in range(0, e, chunk))
    w, s = bench_peer.peer_weights_from_chunks(tk, chunks, e)
    for got, want in ((w, w_all), (s, s_all)):
        assert torch.equal(got.storage.data, want.storage.data)
        assert got.storage.data.stride() == want.storage.data.stride()
        assert list(got.shape) == list(want.shape) and got.dtype == want.dtype
        assert type(got.storage.layout) is type(want.storage.layout)
        assert list(got.storage.layout.initial_shape) == list(want.storage.layout.initial_shape)
    assert w.stride(-2) == 1  # matmul_ogs requires column-major MXFP weights on Hopper
    assert list(w.shape) == [e, k, n]


def test_peer_weights_decode_to_ours_transposed(monkeypatch):
    """build_peer_weights (our NVFP4 experts -> the peer's (E, K, N) MXFP4 in the Hopper layouts, by chunks), with
    the peer's torch downcast standing in for its GPU kernel: chunked == whole, and decoding back with the peer's
    own unswizzle + upcast gives our weights transposed, up to the MXFP4 re-quantization."""
    tk = _peer_or_skip()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch, upcast_from_mxfp_torch

    from megamoe.layers.moe import _random_experts
    from megamoe.ops.quantize import dequantize

    tk = type(tk)(**{**vars(tk), "downcast_to_mxfp": downcast_to_mxfp_torch})
    t = _random_experts(4, (256, 128), 0.1, lambda j: torch.Generator().manual_seed(j), torch.device("cpu"), None,
                        "w")
    w, pc = bench_peer.build_peer_weights(tk, t, chunk=3)
    w1, pc1 = bench_peer.build_peer_weights(tk, t, chunk=4)  # one chunk: convert_layout's own result
    assert torch.equal(w.storage.data, w1.storage.data)
    assert torch.equal(pc.weight_scale.storage.data, pc1.weight_scale.storage.data)
    assert list(w.shape) == [4, 128, 256] and w.stride(-2) == 1
    q = w.storage.layout.unswizzle_data(w.storage.data)
    s = pc.weight_scale.storage.layout.unswizzle_data(pc.weight_scale.storage.data)
    back = upcast_from_mxfp_torch(q, s, torch.float32, axis=1)
    ours = dequantize(t, torch.float32).transpose(1, 2)
    assert bench_peer.rel_err(back, ours) < 0.2  # measured 0.12 (MXFP4 of NVFP4-decoded values)
    assert bench_peer.rel_err(back, ours.roll(1, 0)) > 1.0  # another expert's weights: ~1.4


def test_our_side_matches_reference(monkeypatch):
    """Our timed functions (precomputed dispatch / with dispatch; GEMMs and combine through the interpreter) and
    the bf16 baseline on the benchmark's weights equal the float32 reference the benchmark checks against
    (gate/up interleave convention included). Weights are built and decoded on the torch path (fast)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = MoEConfig(hidden_size=128, intermediate_size=64, num_experts=8, top_k=6, shared_intermediate_size=64)
    w13k, w2 = bench_peer.build_ours(c, seed=0, device=torch.device("cpu"))
    t = 3
    weights, ids = _routing("uniform", t, c.num_experts, c.top_k, seed=5)
    x = torch.randn(t, c.hidden_size).to(torch.bfloat16)
    from megamoe.layers.moe import dispatch_buffers

    gemms, full, d0 = bench_peer.ours_forward_fns(c, w13k, w2, ids, weights,
                                                  dispatch_buffers(t * c.top_k, c.num_experts, "cpu"))
    ref_ours, ref_peer = bench_peer.reference_outputs(c, x, ids, weights, w13k, w2)
    w13b, w2b = bench_peer.bf16_weights(c, w13k, w2, chunk=3)
    b = bench_peer.bf16_forward_fn(c, w13b, w2b, d0, weights)(x)
    assert bench_peer.rel_err(b, ref_ours) < 2e-2
    assert bench_peer.rel_err(ref_peer, ref_ours) > 0.05  # the two SwiGLUs differ: the check can tell them apart
    set_interpret(monkeypatch, "1")
    a = gemms(x).clone()
    assert bench_peer.rel_err(a, ref_ours) < 2e-2
    assert torch.equal(full(x), a)


def test_script_cpu_entry_points():
    p = bench_peer.build_parser()
    args = p.parse_args(["--both-ws", "--tokens", "1,8", "--no-peer"])
    assert args.both_ws and not args.ws and args.tokens == "1,8"
    with pytest.raises(SystemExit):
        p.parse_args(["--ws", "--both-ws"])
    assert bench_peer.target_speedup(64) == 1.2 and bench_peer.target_speedup(512) == 1.25
    if not torch.cuda.is_available():
        assert bench_peer.main(["--quick"]) == 2
