"""L2 prefetch hints (``megamoe/kernels/l2_prefetch.py``): the split of a region over programs and warps, the
arguments of the ops that take it, and on CUDA the same bits with and without it (route + dispatch, the decode
GEMM, the MoE layer eager and in graph replay, sync-free)."""
import pytest
import torch
import triton
import triton.language as tl

from megamoe.kernels.l2_prefetch import prefetch_piece_bounds, prefetch_shares_reference
from megamoe.ops import gemm as gemm_ops
from megamoe.ops import moe as moe_ops
from sync_helpers import no_host_syncs


@pytest.mark.parametrize("nbytes,parts,pieces", [(0, 4, 8), (15, 2, 4), (16, 3, 4), (100, 3, 2), (4096, 7, 8),
                                                 (8 * 1024 * 1024 + 48, 256, 8), (4718592, 32, 8), (1000, 1, 1)])
def test_shares_tile_the_region_once(nbytes, parts, pieces):
    """Every 16-byte granule of [0, nbytes // 16 * 16) is prefetched exactly once; starts and sizes are multiples of
    16; nothing past the region."""
    covered = []
    for part in prefetch_shares_reference(nbytes, parts, pieces):
        assert len(part) == pieces
        for start, size in part:
            assert start % 16 == 0 and size % 16 == 0 and size >= 0
            if size:
                covered.append((start, start + size))
    covered.sort()
    end = 0
    for a, b in covered:
        assert a == end, covered  # no gap, no overlap
        end = b
    assert end == nbytes // 16 * 16


@triton.jit
def _bounds_kernel(out_ptr, nbytes, parts, PIECES: tl.constexpr):
    part = tl.program_id(0)
    piece = tl.arange(0, PIECES)
    start, size = prefetch_piece_bounds(nbytes, part, parts, piece, PIECES)
    tl.store(out_ptr + part * 2 * PIECES + piece * 2, start)
    tl.store(out_ptr + part * 2 * PIECES + piece * 2 + 1, size.to(tl.int64))


@pytest.mark.parametrize("nbytes,parts,pieces", [(100, 3, 2), (4096, 7, 8), (8 * 1024 * 1024 + 48, 5, 4)])
def test_kernel_bounds_equal_the_reference(nbytes, parts, pieces):
    """The Triton helper's arithmetic (interpreter on CPU, compiled on CUDA) equals the Python reference."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full((parts, pieces, 2), -1, dtype=torch.int64, device=dev)
    _bounds_kernel[(parts,)](out, nbytes, parts, PIECES=pieces)
    assert out.cpu().tolist() == [[list(p) for p in part] for part in prefetch_shares_reference(nbytes, parts, pieces)]


def test_route_dispatch_l2_prefetch_is_checked():
    x = torch.randn(2, 64).bfloat16()
    gate = torch.randn(16, 64)
    for bad in ([torch.empty(4)] * 5, "weights", (torch.empty(4), "w")):
        with pytest.raises(ValueError, match="l2_prefetch"):
            moe_ops.route_dispatch(x, gate, None, top_k=2, l2_prefetch=bad)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="l2_prefetch"):
            moe_ops.route_dispatch(x.cuda(), gate.cuda(), None, top_k=2, l2_prefetch=(torch.empty(4),))
    w, ids, _ = moe_ops.route_dispatch(x, gate, None, top_k=2, l2_prefetch=(torch.empty(64),))  # CPU: a no-op
    w0, ids0, _ = moe_ops.route_dispatch(x, gate, None, top_k=2)
    assert torch.equal(w, w0) and torch.equal(ids, ids0)


def test_grouped_mm_l2_prefetch_is_checked():
    from gemm_helpers import random_weight

    w = random_weight((3, 32, 128), "cpu")
    x = torch.randn(4, 128).bfloat16()
    offsets = torch.tensor([1, 3, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="l2_prefetch"):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, l2_prefetch=w.data)
    with pytest.raises(ValueError, match="l2_prefetch"):
        gemm_ops.nvfp4_grouped_mm(x, w, offsets, l2_prefetch=random_weight((2, 32, 128), "cpu"))
    out = gemm_ops.nvfp4_grouped_mm(x, w, offsets, l2_prefetch=random_weight((3, 128, 16), "cpu"))
    assert torch.equal(out, gemm_ops.nvfp4_grouped_mm(x, w, offsets))


def _cuda_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,evict_last", [(1, False), (8, True)])
def test_cuda_route_dispatch_with_l2_prefetch_same_bits(tokens, evict_last):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(tokens)
    experts, hidden, k = 256, 4096, 6
    x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
    gate = (torch.randn(experts, hidden, device=dev, generator=gen) * hidden ** -0.5).float()
    bias = torch.rand(experts, device=dev, generator=gen) * 0.1
    regions = (torch.randint(0, 255, (2048, 1024), dtype=torch.uint8, device=dev),
               torch.randn(4096, 8, device=dev), torch.empty(100, dtype=torch.uint8, device=dev)[3:],  # misaligned
               torch.randn(7, device=dev))
    plain = [t.clone() for t in moe_ops.route_dispatch(x, gate, bias, top_k=k)[:2]]
    moe_ops.route_dispatch(x, gate, bias, top_k=k, l2_prefetch=regions, l2_evict_last=evict_last)  # compile
    torch.cuda.synchronize()
    with no_host_syncs():
        w, ids, _ = moe_ops.route_dispatch(x, gate, bias, top_k=k, l2_prefetch=regions, l2_evict_last=evict_last)
    torch.cuda.synchronize()
    assert torch.equal(w, plain[0]) and torch.equal(ids, plain[1])


@pytest.mark.cuda
@pytest.mark.parametrize("at,evict_last", [(1, False), (2, False), (2, True)])
def test_cuda_decode_gemm_with_next_weight_prefetch_same_bits(monkeypatch, at, evict_last):
    """The mma.sync decode kernel with the next weight's prefetch (before / after the K loop) writes the same bits, on
    the one-wave config (1 token) and the 4-warp one (8 tokens), row-interleaved weights, paired x."""
    from gemm_helpers import random_weight

    from megamoe.kernels.gemm import nvfp4_mma_decode as mma

    _cuda_sm90()
    dev = "cuda"
    monkeypatch.setattr(mma, "NEXT_L2_PREFETCH_AT", at)
    monkeypatch.setattr(mma, "NEXT_L2_PREFETCH_EVICT_LAST", evict_last)
    e, n, k = 9, 1024, 2048
    w13 = random_weight((e, n, k), dev, scale_shape=(e, 1, 1)).interleave_rows(4)
    w2 = random_weight((e, k, n // 2), dev, scale_shape=(e, 1, 1)).interleave_rows(4)
    for tokens in (1, 8):
        ids = torch.stack([torch.randperm(e, device=dev)[:7] for _ in range(tokens)])
        counts = torch.bincount(ids.flatten(), minlength=e)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        row_index = torch.argsort(ids.flatten(), stable=True).div(7, rounding_mode="floor").to(torch.int32)
        x = torch.randn(tokens, k, device=dev).bfloat16()
        kw = dict(activation="swiglu", swiglu_limit=7.0, row_index=row_index, max_rows_per_expert=tokens)
        plain = gemm_ops.nvfp4_grouped_mm(x, w13, offsets, **kw).clone()
        with_pf = gemm_ops.nvfp4_grouped_mm(x, w13, offsets, l2_prefetch=w2, **kw)
        torch.cuda.synchronize()
        assert torch.equal(with_pf, plain), tokens


@pytest.mark.cuda
@pytest.mark.parametrize("route_pf,down_pf", [("gate_up", False), ("all", True)])
@pytest.mark.parametrize("tokens", [1, 8])
def test_cuda_moe_layer_l2_prefetch_same_bits_graph_sync_free(monkeypatch, route_pf, down_pf, tokens):
    """The V4-Flash MoE layer with the route launch's and the gate_up GEMM's L2 prefetch: the same bits as without,
    eager without host syncs and in graph replay."""
    from megamoe.layers import moe
    from megamoe.layers.moe import Nvfp4MoE
    from megamoe.models.config import PRESETS
    from megamoe.ops import errors

    _cuda_sm90()
    config = PRESETS["v4-flash"]
    layer = Nvfp4MoE.random(config, seed=0, max_num_tokens=tokens, device="cuda")
    x = torch.randn(tokens, config.hidden_size, device="cuda").to(torch.bfloat16)
    plain = layer.forward(x).clone()
    monkeypatch.setattr(moe, "ROUTE_L2_PREFETCH", route_pf)
    monkeypatch.setattr(moe, "ROUTE_L2_EVICT_LAST", down_pf)
    monkeypatch.setattr(moe, "DOWN_L2_PREFETCH", down_pf)
    layer.forward(x)  # compile outside the sync check
    torch.cuda.synchronize()
    with no_host_syncs():
        eager = layer.forward(x).clone()
    run = layer.capture(tokens)
    replayed = run(x).clone()
    torch.cuda.synchronize()
    errors.check_errors("cuda")
    assert torch.equal(eager, plain)
    assert torch.equal(replayed, plain)
    monkeypatch.setattr(moe, "ROUTE_L2_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match="ROUTE_L2_PREFETCH"):
        layer.forward(x)
