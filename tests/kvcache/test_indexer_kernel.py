"""Indexer scores kernel v2 (megamoe/kernels/kvcache/indexer.py) on raw paged tensors against an independent float64
decode in this file: official E8M0 scales folded into the decode (bytes 3..136) and the exact per-block
fallback (a tile holding a byte outside that range, NaN 0xFF included), several tiles per program, -inf
for entries past n_entries / without storage."""
import pytest
import torch

from megamoe.kernels.kvcache.indexer import launch_indexer_scores, tiles_per_program

INTERP = not torch.cuda.is_available()
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _reference(q, w, keys, scale_bytes, table, slots, n, T, epb):
    B, H, D = q.shape
    lo, hi = E2M1[(keys & 15).long()], E2M1[(keys >> 4).long()]
    vals = torch.stack([lo, hi], -1).reshape(keys.shape[0], D)
    e = scale_bytes.long().double()
    scale = torch.where(scale_bytes == 255, float("nan"), torch.pow(2.0, e - 127))
    vals = vals * scale.repeat_interleave(32, 1)
    out = torch.full((B, T), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for t in range(min(int(n[b]), T)):
            page = int(table[int(slots[b]), t // epb])
            if page < 0:
                continue
            logit = q[b].double() @ vals[page * epb + t % epb]
            out[b, t] = (w[b].double() * logit.clamp_min(0)).sum()
    return out


@pytest.mark.parametrize("case", ["foldable", "huge_scale", "tiny_scale", "nan_scale"])
@pytest.mark.parametrize("tiles", [1, 2])
def test_official_scores_fold_and_exact_fallback(device, case, tiles):
    B, H, D, epb, pages = 2, 16, 128, 16, 6
    g = torch.Generator().manual_seed(5)
    q = (torch.randn((B, H, D), generator=g) * 0.5).to(torch.bfloat16)
    w = torch.randn((B, H), generator=g)
    keys = torch.randint(0, 256, (pages * epb, D // 2), generator=g, dtype=torch.uint8)
    sb = torch.randint(118, 130, (pages * epb, D // 32), generator=g, dtype=torch.uint8)
    if case == "huge_scale":
        sb[2 * epb + 3, 1] = 140        # 2**13: not foldable into the bf16 decode factor
    elif case == "tiny_scale":
        sb[1 * epb + 5, 2] = 1          # 2**-126
    elif case == "nan_scale":
        sb[3 * epb + 7, 0] = 255
    table = torch.tensor([[2, 0, 4, -1], [1, 3, 5, 0]], dtype=torch.int32)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    n = torch.tensor([60, 45], dtype=torch.int32)
    T = 64
    want = _reference(q, w, keys, sb, table, slots, n, T, epb)
    dev = torch.device(device)
    scores = torch.empty((B, T), dtype=torch.float32, device=dev)
    launch_indexer_scores(q.to(dev), w.to(dev), slots.to(dev), n.to(dev), table.to(dev), keys.to(dev), sb.to(dev),
                          scores, entries_per_block=epb, official=True, interpreter=INTERP, tiles=tiles)
    got = scores.cpu().double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), case
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    ok = torch.isfinite(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5 * float(want[ok].abs().max()))
    if case == "nan_scale":
        assert bool(torch.isnan(got).any())


def test_tiles_per_program_choice():
    assert tiles_per_program(1, 131072) == 1           # batch 1: 256 single-tile programs (all SMs busy)
    assert tiles_per_program(128, 131072) == 8         # batch 128: the query load amortised over 8 tiles
    assert tiles_per_program(128, 4096) in (1, 2)
