"""Skew-robust grouped GEMM schedule (issue 10, NOTES_gemm.md v12): row bands and row chunks.

CPU: the work list of the chunked Gluon kernels (``chunk_schedule_reference``, the
Python twin of ``nvfp4_gluon_jit.grouped_tile_table`` / ``nvfp4_mma_decode.chunk_rows``), the host grid
bound, and the band plan of the "banded" route cover every row exactly once for any
routing (empty experts, one expert holding every row, counts that are not multiples
of the tile). CUDA: the banded route against float32 math under skewed routings,
CUDA-graph replay equal to eager after the routing is rewritten in place, sync-free.
"""
import random

import pytest
import torch

from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.ops import gemm as ops_gemm
from gemm_helpers import sync_free_graph  # tests/gemm_helpers.py (tests/ is on sys.path)

UNB = mma.ROW_HI_UNBOUNDED


def _offsets(counts):
    out, s = [], 0
    for c in counts:
        s += c
        out.append(s)
    return out


def _routings(e, t, rng):
    """Adversarial and random per-expert row counts summing to at most t (the rest is padding)."""
    yield [0] * e
    yield [t] + [0] * (e - 1)  # one expert holds every row
    yield [0] * (e - 1) + [t]
    yield [1] * min(e, t) + [0] * (e - min(e, t))
    if e >= 6:
        yield [t // 6 + (i < t % 6) for i in range(6)] + [0] * (e - 6)  # all on top-6
    for _ in range(20):
        cut = sorted(rng.randrange(t + 1) for _ in range(e))
        counts = [b - a for a, b in zip([0] + cut[:-1], cut)]
        rng.shuffle(counts)
        yield counts
    w = [1.0 / (i + 1) ** 1.2 for i in range(e)]  # Zipf
    counts = [0] * e
    for i in rng.choices(range(e), weights=w, k=t - 3):
        counts[i] += 1
    yield counts


def _covered(items, t):
    rows = [0] * t
    for _, s, e in items:
        for r in range(s, e):
            rows[r] += 1
    return rows


@pytest.mark.parametrize("block_m", [8, 32, 5])
def test_chunk_schedule_covers_rows_once(block_m):
    rng = random.Random(block_m)
    for e, t in [(1, 1), (4, 37), (16, 203), (257, 400)]:
        for counts in _routings(e, t, rng):
            offs = _offsets(counts)
            items = mma.chunk_schedule_reference(offs, t, block_m)
            assert _covered(items, t) == [1] * t
            assert all(0 < end - s <= block_m for _, s, end in items)
            for ex, s, end in items:  # each chunk lies inside its expert's rows (expert E: padding)
                lo = offs[ex - 1] if ex else 0
                hi = offs[ex] if ex < e else t
                assert lo <= s < end <= hi
            assert len(items) <= mma.chunk_bound(t, e, block_m)


def test_chunk_schedule_edge_cases():
    # empty experts, a ragged last chunk, padding rows, offsets past T clamped
    assert mma.chunk_schedule_reference([0, 0, 0], 0, 8) == []
    assert mma.chunk_schedule_reference([0, 19, 19], 22, 8) == [(1, 0, 8), (1, 8, 16), (1, 16, 19), (3, 19, 22)]
    assert mma.chunk_schedule_reference([5, 50], 20, 8) == [(0, 0, 5), (1, 5, 13), (1, 13, 20)]
    assert mma.chunk_schedule_reference([0, 19, 19], 22, 8, own_pad=False)[-1] == (1, 16, 19)
    # band: only experts with lo < rows <= hi
    assert mma.chunk_schedule_reference([3, 12, 12, 40], 40, 8, 3, 9, False) == [(1, 3, 11), (1, 11, 12)]


@pytest.mark.parametrize("pipe_bands,tail", [(False, False), (True, False), (True, True)])
def test_bands_partition_every_routing(monkeypatch, pipe_bands, tail):
    """The launches of plan_row_bands take every expert exactly once (any row count up to T), the first
    owns the padding, the last band is unbounded (a wrong max_rows_per_expert hint never drops rows); with
    PIPE_BANDS as well (pipelined bands by BLOCK_M), and PIPE_TAIL (96-row tiles)."""
    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    monkeypatch.setattr(ops_gemm, "PIPE_BANDS", pipe_bands)
    monkeypatch.setattr(ops_gemm, "PIPE_TAIL", tail)
    rng = random.Random(0)
    for t, e, hint in [(7, 257, 1), (56, 257, 8), (56, 257, None), (384, 256, 64), (3072, 256, 512),
                       (24576, 256, 4096), (64, 1, None), (100, 8, 3)]:
        plan = ops_gemm.plan_row_bands(t, e, 4096, hint)
        bands = [kw["row_band"] if route == "mma" else (kw["row_lo"], kw.get("row_hi", UNB)) for route, kw in plan]
        if pipe_bands and t >= 3072:
            assert [route for route, _ in plan][-3:] == ["pipe"] * 3
        assert bands[0][0] == 0 and bands[-1][1] == UNB
        assert all(a[1] == b[0] for a, b in zip(bands, bands[1:]))
        assert [kw["own_pad"] for _, kw in plan] == [True] + [False] * (len(plan) - 1)
        for counts in _routings(e, t, rng):
            items = []
            for (route, kw), (lo, hi) in zip(plan, bands):
                bm = kw["config"][0] if "config" in kw else 128
                mine = mma.chunk_schedule_reference(_offsets(counts), t, bm, lo, hi, kw["own_pad"])
                if route == "mma" and max(counts) <= kw["max_rows_per_expert"]:  # the grid bound holds
                    assert len(mine) <= mma.chunk_bound(t, e, bm, lo, hi, kw["own_pad"], kw["max_rows_per_expert"])
                items += mine
            assert _covered(items, t) == [1] * t


def test_band_plan_keeps_decode_and_adds_launches_only_where_needed(monkeypatch):
    decode = mma.select_mma_decode_config(1, 4096)
    # 1-8 tokens of a top-k layer (hint = tokens <= 8): one launch, the previous decode kernel and config
    for tokens in (1, 2, 8):
        plan = ops_gemm.plan_row_bands(7 * tokens, 257, 4096, tokens)
        assert len(plan) == 1 and plan[0][0] == "mma" and plan[0][1]["config"] == decode
    # 64 tokens: decode band + the 32-row band (hot experts up to 64 rows), no wgmma launch, with the pipelined
    # kernel on (the default) or off
    assert [r for r, _ in ops_gemm.plan_row_bands(384, 256, 4096, 64)] == ["mma", "mma"]
    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", False)
    assert [r for r, _ in ops_gemm.plan_row_bands(384, 256, 4096, 64)] == ["mma", "mma"]
    # 512 tokens (12 rows per expert on average): 16-row tiles up to 16 rows (MMA16_BAND), 32-row chunks up to 64,
    # wgmma above; 4096 tokens (96 on average): no 16-row band
    # MEGAMOE_PIPE_ROUTE=0: the synchronous wgmma top band
    plan = ops_gemm.plan_row_bands(3072, 256, 4096, 512)
    assert [r for r, _ in plan] == ["mma", "mma", "wgmma"] and plan[2][1]["row_lo"] == mma.MMA_MAX_BAND_ROWS
    assert plan[0][1]["config"][0] == 16 and plan[0][1]["row_band"] == (0, mma.MMA16_BAND_ROWS)
    assert plan[1][1]["row_band"] == (mma.MMA16_BAND_ROWS, mma.MMA_MAX_BAND_ROWS)
    plan = ops_gemm.plan_row_bands(24576, 256, 4096, 4096)
    assert [r for r, _ in plan] == ["mma", "wgmma"] and plan[1][1]["row_lo"] == mma.MMA_MAX_BAND_ROWS
    monkeypatch.setattr(ops_gemm, "MMA16_BAND", False)  # MEGAMOE_MMA16_BAND=0: the previous plan
    assert [r for r, _ in ops_gemm.plan_row_bands(3072, 256, 4096, 512)] == ["mma", "wgmma"]
    # the pipelined kernel (default, with PIPE_BANDS and PIPE_SMALL) takes every band where K % 256 == 0 and there
    # is no decode band: 16 / 32-row bands two programs per SM, then 64 / 128-row tiles
    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    monkeypatch.setattr(ops_gemm, "MMA16_BAND", True)
    monkeypatch.setattr(ops_gemm, "PIPE_TAIL", False)
    for t, hint in ((24576, 4096), (3072, 512)):
        plan = ops_gemm.plan_row_bands(t, 256, 4096, hint)
        assert [(r, kw["config"][0], kw["row_lo"]) for r, kw in plan] == [
            ("pipe", 16, 0), ("pipe", 32, 16), ("pipe", 64, 32), ("pipe", 128, 64)]
    # PIPE_TAIL: 96 (64 + 32)-row tiles for the experts of 65-96 and 129-192 rows
    monkeypatch.setattr(ops_gemm, "PIPE_TAIL", True)
    plan = ops_gemm.plan_row_bands(24576, 256, 4096, 4096)
    assert [(r, kw["config"][0], kw["row_lo"], kw["row_hi"]) for r, kw in plan] == [
        ("pipe", 16, 0, 16), ("pipe", 32, 16, 32), ("pipe", 64, 32, 64), ("pipe", 96, 64, 96), ("pipe", 128, 96, 128),
        ("pipe", 96, 128, 192), ("pipe", 128, 192, UNB)]
    # a band no expert can reach is not launched: at most 80 rows per expert, no 128-row band
    plan = ops_gemm.plan_row_bands(24576, 256, 4096, 80)
    assert [(kw["config"][0], kw["row_hi"]) for _, kw in plan][-1] == (96, UNB)
    monkeypatch.setattr(ops_gemm, "PIPE_TAIL", False)
    monkeypatch.setattr(ops_gemm, "PIPE_SMALL", False)  # MEGAMOE_PIPE_SMALL=0
    assert [r for r, _ in ops_gemm.plan_row_bands(24576, 256, 4096, 4096)] == ["pipe"] * 3
    assert [r for r, _ in ops_gemm.plan_row_bands(3072, 256, 4096, 512)] == ["mma"] + ["pipe"] * 3
    assert [r for r, _ in ops_gemm.plan_row_bands(24576, 256, 4096 + 128, 4096)] == ["mma", "wgmma"]
    monkeypatch.setattr(ops_gemm, "PIPE_BANDS", False)  # MEGAMOE_PIPE_BANDS=0: the top band only
    assert [r for r, _ in ops_gemm.plan_row_bands(24576, 256, 4096, 4096)] == ["mma", "pipe"]
    assert [r for r, _ in ops_gemm.plan_row_bands(384, 256, 4096, 64)] == ["mma", "mma"]


def test_resident_programs():
    # registers of the sm_90 builds (offline ptxas): 135 / 128 (BLOCK_M 8), 227 (BLOCK_M 32), 4 warps
    assert mma.resident_programs(135, 4) == 3 and mma.resident_programs(128, 4) == 4
    assert mma.resident_programs(227, 4) == 2 and mma.resident_programs(255, 8) == 1
    assert mma.resident_programs(32, 4) == 16 and mma.resident_programs(64, 4, 100 * 1024) == 2
    n_tiles, g = mma.mma_decode_grid(132, 3, 4096, 10 ** 6, 128)
    assert n_tiles == 32 and g * n_tiles <= 3 * 132
    assert mma.mma_decode_grid(132, 3, 4096, 5, 128) == (32, 5)


def test_max_rows_hint_is_validated():
    from megamoe.reference.quantize import quantize

    w = quantize(torch.randn(2, 32, 64) * 0.05)
    x = torch.randn(4, 64).bfloat16()
    offs = torch.tensor([1, 4], dtype=torch.int32)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_rows_per_expert"):
            ops_gemm.nvfp4_grouped_mm(x, w, offs, max_rows_per_expert=bad)
    ref = ops_gemm.nvfp4_grouped_mm(x, w, offs)
    assert torch.equal(ops_gemm.nvfp4_grouped_mm(x, w, offs, max_rows_per_expert=1), ref)  # a wrong hint


# ----------------------------------------------------------------------------- GPU


def _skewed_counts(kind, e, t, gen):
    if kind == "one":
        c = torch.zeros(e, dtype=torch.int64)
        c[e // 2] = t
        return c
    if kind == "top6":
        c = torch.zeros(e, dtype=torch.int64)
        c[torch.randperm(e, generator=gen)[:6]] = torch.tensor([t // 6 + (i < t % 6) for i in range(6)])
        return c
    if kind == "zipf":
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
        return torch.bincount(torch.multinomial(p, t, replacement=True, generator=gen), minlength=e)
    return torch.bincount(torch.randint(0, e, (t,), generator=gen), minlength=e)


@pytest.mark.cuda
@pytest.mark.parametrize("pipe_bands", [False, True])
@pytest.mark.parametrize("kind", ["one", "top6", "zipf", "uniform"])
@pytest.mark.parametrize("t,hint", [(56, 8), (56, None), (384, 64), (3000, 500), (9000, None)])
def test_cuda_banded_skewed_matches_float32(monkeypatch, kind, t, hint, pipe_bands):
    from gemm_helpers import grouped_f32, random_weight, rel_err

    monkeypatch.setattr(ops_gemm, "PIPE_BANDS", pipe_bands)

    device = torch.device("cuda")
    e, n, k = 40, 256, 512
    gen = torch.Generator().manual_seed(t)
    counts = _skewed_counts(kind, e, t - 3, gen)
    if hint is not None:
        counts = counts.clamp(max=hint)
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    real = int(counts.sum())
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    assert ops_gemm.decode_route(x, w.data, t, e, n, k) == "banded"
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    ops_gemm.nvfp4_grouped_mm(x, w, offsets, row_index=row_index, out=out, max_rows_per_expert=hint)
    assert (out[real:] == 0).all(), "padding rows must be 0"
    ref = grouped_f32(x, w, offsets, row_index)
    assert rel_err(out[:real], ref[:real]) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("t", [7, 56, 3000])
def test_cuda_swiglu_limit_keeps_nan_rows(t):
    """A NaN activation row through gate_up + SwiGLU with a clamp limit gives NaN outputs on every kernel the
    op plans (decode, mma.sync and pipelined bands, the 128-row pipelined tile), as the reference's clamp does; the
    other rows keep their values. (The Gluon epilogue's clamp was min.f32, which returns the limit for NaN: a NaN
    token came out as limit * silu(limit).)"""
    from gemm_helpers import random_weight
    from megamoe.reference import gemm as ref_gemm

    device = torch.device("cuda")
    e, n, k = 16, 256, 512
    counts = torch.tensor([t // 2, t // 4, 1] + [0] * 12 + [t - t // 2 - t // 4 - 1])
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    w = ops_gemm.interleave_gate_up(random_weight((e, n, k), device, scale_shape=(e, 1, 1)))
    x = torch.randn(t, k, device=device).bfloat16()
    bad = sorted({0, t // 2, t - 1})  # the first rows of the largest expert, of the second, and the last expert's
    x[bad, 3] = float("nan")
    out = ops_gemm.nvfp4_grouped_mm(x, w, offsets, activation="swiglu", swiglu_limit=7.0)
    ref = ref_gemm.nvfp4_grouped_mm(x.cpu(), w.to("cpu"), offsets.cpu(), activation="swiglu", swiglu_limit=7.0)
    assert torch.isnan(ref[bad]).all()
    assert torch.equal(torch.isnan(out.cpu()), torch.isnan(ref)), torch.isnan(out.cpu()).any(1).nonzero().flatten()


@pytest.mark.cuda
@pytest.mark.parametrize("pipe_bands", [False, True])
@pytest.mark.parametrize("t,hint", [(384, 64), (3000, None)])
def test_cuda_banded_graph_replay_with_routing_moved(monkeypatch, t, hint, pipe_bands):
    """Captured under uniform routing, replayed after every row moved to one expert (and back to Zipf):
    equal to eager bit for bit, sync-free, and correct; SwiGLU epilogue."""
    from gemm_helpers import grouped_f32, random_weight, rel_err
    from megamoe.reference.gemm import interleave_gate_up, swiglu_reference

    monkeypatch.setattr(ops_gemm, "PIPE_BANDS", pipe_bands)

    device = torch.device("cuda")
    e, i, k = 40, 128, 512
    plain = random_weight((e, 2 * i, k), device, scale_shape=(e, 1, 1))
    w = interleave_gate_up(plain)
    gen = torch.Generator().manual_seed(1)
    offsets = _skewed_counts("uniform", e, t, gen).cumsum(0).to(torch.int32).to(device)
    x = torch.randn(t, k, device=device).bfloat16()
    out = torch.empty(t, i, dtype=torch.bfloat16, device=device)

    def launch():
        return ops_gemm.nvfp4_grouped_mm(x, w, offsets, out=out, activation="swiglu", swiglu_limit=7.0,
                                         max_rows_per_expert=hint)

    launch()  # compile outside the sync check
    graph, _ = sync_free_graph(launch)
    for kind in ("one", "zipf", "top6"):
        counts = _skewed_counts(kind, e, t, gen)
        if hint is not None:
            counts = counts.clamp(max=hint)
        offsets.copy_(counts.cumsum(0).to(torch.int32))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert torch.equal(replayed, launch()), f"graph replay differs from eager ({kind})"
        real = int(counts.sum())
        y = grouped_f32(x, plain, offsets)
        inter = torch.stack((y[:, :i], y[:, i:]), dim=-1).reshape(t, 2 * i)
        assert rel_err(replayed[:real], swiglu_reference(inter, 7.0)[:real]) < 4e-3, kind
        assert (replayed[real:] == 0).all()


def test_plan_row_bands_for_row_interleaved_weights():
    """Row-interleaved weights: the row-major plan (the decode build reads the layout at the row-major speed since
    its register cap, INTERLEAVED_MAXNREG), and a plan with a launch that cannot read the layout (K % 256 != 0: no
    pipelined band) is refused on the host."""
    for args in ((9, 6, 512, 3), (384, 257, 4096, 64)):
        assert ops_gemm.plan_row_bands(*args) == ops_gemm.plan_row_bands(*args, weight_interleave=4)
        assert tuple(ops_gemm.plan_row_bands(*args, weight_interleave=4)[0][1]["config"])[:2] == (8, 128)
    with pytest.raises(ValueError, match="row_interleave"):
        ops_gemm.plan_row_bands(100, 4, 384, weight_interleave=4)


@pytest.mark.cuda
@pytest.mark.parametrize("interleave,after_decode", [(1, False), (4, False), (4, True), (4, "above"),
                                                     (4, "above-wide")])
@pytest.mark.parametrize("t,hint", [(56, 56), (384, 64), (3000, None)])
@pytest.mark.parametrize("knob", ["BANDS_CONCURRENT", "BANDS_OVERLAP"])
def test_cuda_concurrent_bands_same_bits(monkeypatch, interleave, after_decode, t, hint, knob):
    """BANDS_CONCURRENT (the bands on side streams) and BANDS_OVERLAP (later bands launched with PDL beside the earlier
    ones, waiting for them only at exit) write the same bits as the launches in order, eager and in a sync-free graph
    replayed after the routing moved; PIPE_AFTER_DECODE's and PIPE_ABOVE_MMA_ROWS's plans too (within float32
    bounds)."""
    from gemm_helpers import grouped_f32, random_weight, rel_err

    device = torch.device("cuda")
    e, n, k = 40, 256, 512
    w = random_weight((e, n, k), device, scale_shape=(e, 1, 1))
    wk = w.interleave_rows(interleave) if interleave > 1 else w
    gen = torch.Generator().manual_seed(t)
    counts = _skewed_counts("zipf", e, t - 3, gen)
    if hint is not None:
        counts = counts.clamp(max=hint)
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    x = torch.randn(t, k, device=device).bfloat16()
    row_index = torch.randperm(t, device=device).to(torch.int32)
    monkeypatch.setattr(ops_gemm, "PIPE_AFTER_DECODE", after_decode is True)
    monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_MMA_ROWS", 32 if str(after_decode).startswith("above") else 0)
    if after_decode == "above-wide":  # N 256: the narrow band by default; this takes the wide one
        monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_WIDE_N", 0)
    outs = {}
    seen = []
    monkeypatch.setattr(ops_gemm, "BANDS_OVERLAP", False)
    monkeypatch.setattr(ops_gemm, "BANDS_CONCURRENT", False)
    real_launcher = ops_gemm._launcher

    def spy(route):
        launch = real_launcher(route)

        def run(*args, **kwargs):
            if route != "banded":
                seen.append((kwargs.get("after_band", False), "splits" in kwargs))
            return launch(*args, **kwargs)
        return run

    monkeypatch.setattr(ops_gemm, "_launcher", spy)
    for concurrent in (False, True):
        monkeypatch.setattr(ops_gemm, knob, concurrent)
        seen.clear()
        out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)

        def launch():
            return ops_gemm.nvfp4_grouped_mm(x, wk, offsets, row_index=row_index, out=out, max_rows_per_expert=hint)

        launch()
        outs[concurrent] = out.clone()
        if knob == "BANDS_OVERLAP":  # every later band of a plan with a decode band overlaps its predecessor
            overlaps = concurrent and seen[0][1]
            assert not seen[0][0] and all(after == overlaps for after, _ in seen[1:]), seen
        graph, _ = sync_free_graph(launch)
        for kind in ("one", "uniform"):
            moved = _skewed_counts(kind, e, t - 3, gen)
            if hint is not None:
                moved = moved.clamp(max=hint)
            offsets.copy_(moved.cumsum(0).to(torch.int32))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            assert torch.equal(replayed, launch()), (concurrent, kind)
            real = int(moved.sum())
            assert (replayed[real:] == 0).all()
            assert rel_err(replayed[:real], grouped_f32(x, w, offsets, row_index)[:real]) < 4e-3
        offsets.copy_(counts.cumsum(0).to(torch.int32).to(device))
    assert torch.equal(outs[True], outs[False])
    real = int(counts.sum())
    assert rel_err(outs[True][:real], grouped_f32(x, w, offsets, row_index)[:real]) < 4e-3


def test_plan_pipe_after_decode(monkeypatch):
    """PIPE_AFTER_DECODE (opt-in): on row-interleaved weights the rows above the decode band take the pipelined bands
    (16 / 32 / 64-row tiles) instead of the mma.sync 32-row chunks; row-major weights keep the chunks."""
    args = (384, 257, 4096, 64)  # 64 tokens of top-6 over 256 experts + the shared one
    monkeypatch.setattr(ops_gemm, "PIPE_AFTER_DECODE", False)
    before = ops_gemm.plan_row_bands(*args, weight_interleave=4)
    assert [r for r, _ in before] == ["mma", "mma"]
    monkeypatch.setattr(ops_gemm, "PIPE_AFTER_DECODE", True)
    assert ops_gemm.plan_row_bands(*args) == before
    plan = ops_gemm.plan_row_bands(*args, weight_interleave=4)
    assert plan[0] == before[0] and [r for r, _ in plan] == ["mma", "pipe", "pipe", "pipe"]
    bands = [(b["row_lo"], b["row_hi"], b["config"][0]) for _, b in plan[1:]]
    assert bands == [(8, 16, 16), (16, 32, 32), (32, mma.ROW_HI_UNBOUNDED, 64)], bands


@pytest.mark.parametrize("n", [6144, 4096])
def test_plan_pipe_above_mma_rows(monkeypatch, n):
    """PIPE_ABOVE_MMA_ROWS: on row-interleaved weights with a decode band, the mma.sync 32-row chunks keep the experts
    of up to 32 rows and a pipelined 64-row band (then the usual pipelined band) takes those above: 256-column tiles
    where N >= PIPE_ABOVE_WIDE_N, else 128-column ones and only while the row hint is <= 64. Every routing is still
    covered once; row-major weights, 0 and PIPE_AFTER_DECODE's plan are unchanged by it."""
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    monkeypatch.setattr(ops_gemm, "PIPE_AFTER_DECODE", False)
    monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_MMA_ROWS", 0)
    wide = n >= ops_gemm.PIPE_ABOVE_WIDE_N
    before = {t: ops_gemm.plan_row_bands(6 * t, 385, 7168, t, weight_interleave=4, n=n) for t in (16, 64, 128)}
    row_major = {t: ops_gemm.plan_row_bands(6 * t, 385, 7168, t, n=n) for t in (64, 128)}
    monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_MMA_ROWS", 32)
    assert ops_gemm.plan_row_bands(16 * 6, 385, 7168, 16, weight_interleave=4, n=n) == before[16]  # none above 32
    at128 = ops_gemm.plan_row_bands(128 * 6, 385, 7168, 128, weight_interleave=4, n=n)
    assert (at128 != before[128]) if wide else (at128 == before[128])  # narrow tiles only while the hint <= 64
    for t in (64, 128) if wide else (64,):
        assert ops_gemm.plan_row_bands(6 * t, 385, 7168, t, n=n) == row_major[t]
        plan = ops_gemm.plan_row_bands(6 * t, 385, 7168, t, weight_interleave=4, n=n)
        assert plan != before[t] and plan[0] == before[t][0]
        bands = [(r, kw["row_band"] if r == "mma" else (kw["row_lo"], kw.get("row_hi", UNB))) for r, kw in plan]
        expected = [("mma", (0, 8)), ("mma", (8, 32)), ("pipe", (32, 64 if t > 64 else UNB))]
        assert bands == expected + ([("pipe", (64, UNB))] if t > 64 else []), bands
        assert plan[2][1]["config"] == (pipe.PIPE_BAND_CONFIGS[64] if wide else pipe.PIPE_BAND64_NARROW_CONFIG)
        rng = random.Random(t)
        for counts in _routings(385, 6 * t, rng):
            items = []
            for route, kw in plan:
                lo, hi = kw["row_band"] if route == "mma" else (kw["row_lo"], kw.get("row_hi", UNB))
                bm = kw["config"][0] if "config" in kw else 128
                items += mma.chunk_schedule_reference(_offsets(counts), 6 * t, bm, lo, hi, kw["own_pad"])
            assert _covered(items, 6 * t) == [1] * (6 * t)
    monkeypatch.setattr(ops_gemm, "PIPE_AFTER_DECODE", True)
    monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_MMA_ROWS", 0)
    after = ops_gemm.plan_row_bands(384, 385, 7168, 64, weight_interleave=4, n=n)
    monkeypatch.setattr(ops_gemm, "PIPE_ABOVE_MMA_ROWS", 32)
    assert ops_gemm.plan_row_bands(384, 385, 7168, 64, weight_interleave=4, n=n) == after


def test_tile_list_plan_covers_every_routing(monkeypatch):
    """With PIPE_LIST: the bands up to 32 rows as before, then one tile-list launch (row_lo = the last band's edge,
    unbounded above); its lists (nvfp4_wgmma_pipe.tile_list_reference) and the bands below take every row once."""
    from megamoe.kernels.gemm import nvfp4_wgmma_pipe as pipe

    monkeypatch.setattr(ops_gemm, "PIPE_ROUTE", True)
    monkeypatch.setattr(ops_gemm, "PIPE_LIST", True)
    rng = random.Random(3)
    for t, e, hint in [(3072, 256, 512), (24576, 256, 4096), (4000, 8, None)]:
        plan = ops_gemm.plan_row_bands(t, e, 4096, hint)
        assert plan[-1][0] == "pipe" and plan[-1][1].get("tile_list") and "row_hi" not in plan[-1][1], plan
        assert sum(bool(kw.get("tile_list")) for _, kw in plan) == 1
        lo = plan[-1][1]["row_lo"]
        for counts in _routings(e, t, rng):
            items = []
            for route, kw in plan[:-1]:
                hi = kw["row_band"][1] if route == "mma" else kw["row_hi"]
                low = kw["row_band"][0] if route == "mma" else kw["row_lo"]
                items += mma.chunk_schedule_reference(_offsets(counts), t, kw["config"][0], low, hi, kw["own_pad"])
            list_a, list_b = pipe.tile_list_reference(_offsets(counts), t, lo, plan[-1][1]["own_pad"])
            heights = {0: 128, 1: 96, 2: 64}
            items += [(ex, s, min(s + heights[kind], end)) for ex, s, end, kind in list_a + list_b]
            assert _covered(items, t) == [1] * t
    monkeypatch.setattr(ops_gemm, "PIPE_TAIL", False)  # the lists hold 96-row tiles: only with PIPE_TAIL
    assert not any(kw.get("tile_list") for _, kw in ops_gemm.plan_row_bands(24576, 256, 4096, 4096))


def test_decode_band_takes_the_one_wave_config_only_where_its_items_fit_one_wave(monkeypatch):
    """The decode band's 8-warp config (nvfp4_mma_decode.one_wave_decode_config) is planned where the band's work items
    (chunk bound with padding x n-tiles) fit in one wave of 2 programs per SM: V4-Flash at 1 token (gate_up and down),
    not V4-Pro at 1 token nor V4-Flash from 2 tokens, never without N / the SM count, with the switch off or with a K
    that its BLOCK_K does not divide."""
    one_wave = mma.MMA_DECODE_ONE_WAVE_CONFIG
    assert one_wave[:3] == mma.MMA_DECODE_CONFIGS[4][:3] and one_wave[3] == 8
    assert mma.DECODE_MAXNREG[one_wave] == 128

    def decode_config(pairs, e, k, n, t, **kw):
        plan = ops_gemm.plan_row_bands(pairs, e, k, t, weight_interleave=4, n=n, **kw)
        assert plan[0][0] == "mma" and "splits" in plan[0][1]
        return plan[0][1]["config"]

    for k, n in ((4096, 4096), (2048, 4096)):  # V4-Flash gate_up, down: 8 chunks x 32 n-tiles = 256 <= 264
        assert decode_config(7, 257, k, n, 1, num_sms=132) == one_wave
        assert decode_config(14, 257, k, n, 2, num_sms=132) == mma.MMA_DECODE_CONFIGS[4]
        assert decode_config(7, 257, k, n, 1, num_sms=120) == mma.MMA_DECODE_CONFIGS[4]  # 256 > 240
        assert decode_config(7, 257, k, n, 1) == mma.MMA_DECODE_CONFIGS[4]  # no SM count (CPU, interpreter)
    for k, n in ((7168, 6144), (3072, 7168)):  # V4-Pro: 8 x 48 / 8 x 56 items
        assert decode_config(7, 385, k, n, 1, num_sms=132) == mma.MMA_DECODE_CONFIGS[4]
    assert decode_config(7, 257, 4224, 4096, 1, num_sms=132)[3] == 4  # K % 256 != 0
    monkeypatch.setattr(mma, "DECODE_ONE_WAVE", False)
    assert decode_config(7, 257, 4096, 4096, 1, num_sms=132) == mma.MMA_DECODE_CONFIGS[4]
    # the 4-warp decode config keeps its build keywords (SASS-identical default), the one-wave one gets its cap
    assert mma.interleave_constants(mma.MMA_DECODE_CONFIGS[4], 0, 1) == {}
    assert mma.interleave_constants(mma.MMA_DECODE_CONFIGS[4], 0, 4) == {"W_IL": 4, "maxnreg": 168}
    assert mma.interleave_constants(one_wave, 0, 1) == {"maxnreg": 128}
    assert mma.interleave_constants(one_wave, 0, 4) == {"W_IL": 4, "maxnreg": 128}


def test_one_expert_takes_split_k_chunks(monkeypatch):
    """ONE_EXPERT_SPLITK_MAX_ROWS: a grouped GEMM of one expert (the shared expert) with 9..max rows is one mma.sync
    launch of 32-row chunks with planned split-K, on both layouts;
    1-8 rows, more rows, or more experts keep the plan."""
    monkeypatch.setattr(ops_gemm, "ONE_EXPERT_SPLITK_MAX_ROWS", 256)
    for t in (9, 64, 256):
        for interleave in (1, 4):
            plan = ops_gemm.plan_row_bands(t, 1, 4096, None, weight_interleave=interleave)
            assert [r for r, _ in plan] == ["mma"]
            band = plan[0][1]
            assert band["splits"] is None and band["row_band"] == (0, UNB) and band["own_pad"]
            assert band["config"][0] == 32 and band["max_rows_per_expert"] == t
    for args in ((8, 1, 4096, None), (257, 1, 4096, None), (64, 2, 4096, None)):
        on = ops_gemm.plan_row_bands(*args)
        monkeypatch.setattr(ops_gemm, "ONE_EXPERT_SPLITK_MAX_ROWS", 0)
        assert ops_gemm.plan_row_bands(*args) == on, args
        monkeypatch.setattr(ops_gemm, "ONE_EXPERT_SPLITK_MAX_ROWS", 256)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [9, 64, 200])
@pytest.mark.parametrize("interleave", [1, 4])
def test_cuda_one_expert_split_k_matches_float32(monkeypatch, t, interleave):
    """The one-expert split-K plan: gate_up with SwiGLU (gate / up interleaved) and a plain GEMM against float32 math,
    on row-major and row-interleaved weights; graph replay == eager, sync-free."""
    from gemm_helpers import grouped_f32, random_weight, rel_err
    from megamoe.reference.gemm import swiglu_reference

    monkeypatch.setattr(ops_gemm, "ONE_EXPERT_SPLITK_MAX_ROWS", 256)
    device = torch.device("cuda")
    n, k = 512, 1024
    w = random_weight((1, n, k), device)
    offsets = torch.tensor([t], dtype=torch.int32, device=device)
    x = torch.randn(t, k, device=device).bfloat16()
    wk = w.interleave_rows(interleave) if interleave > 1 else w
    out = ops_gemm.nvfp4_grouped_mm(x, wk, offsets)
    assert rel_err(out, grouped_f32(x, w, offsets)) < 4e-3
    wi = ops_gemm.interleave_gate_up(w)
    wik = wi.interleave_rows(interleave) if interleave > 1 else wi
    sw = ops_gemm.nvfp4_grouped_mm(x, wik, offsets, activation="swiglu", swiglu_limit=7.0)
    y = grouped_f32(x, w, offsets)
    inter = torch.stack((y[:, : n // 2], y[:, n // 2:]), dim=-1).reshape(t, n)
    assert rel_err(sw, swiglu_reference(inter, 7.0)) < 4e-3
    buf = torch.empty(t, n // 2, dtype=torch.bfloat16, device=device)
    graph, _ = sync_free_graph(lambda: ops_gemm.nvfp4_grouped_mm(x, wik, offsets, activation="swiglu",
                                                                 swiglu_limit=7.0, out=buf))
    buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, sw)


def test_early_reads_only_for_a_gemm_of_one_launch(monkeypatch):
    """index_settled's early reads go to an mma.sync launch only when it is the plan's one launch: an early-reading
    program without rows exits without waiting, so a band launched on it could run before x is complete."""
    calls = []
    monkeypatch.setattr(ops_gemm, "_launcher", lambda route: lambda *a, **kw: calls.append((route, kw)))
    out = torch.zeros(4, 64, dtype=torch.bfloat16)
    args = (torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(3, 64, 128, dtype=torch.uint8), None, None, out)
    one = [("mma", dict(row_band=(0, 8), splits=1))]
    two = one + [("mma", dict(row_band=(8, 64)))]
    for plan, want in ((one, [True]), (two, [False, False])):
        monkeypatch.setattr(ops_gemm, "plan_row_bands", lambda *a, plan=plan, **k: [(r, dict(b)) for r, b in plan])
        calls.clear()
        ops_gemm._launch_banded(*args, expert_offsets=None, early_reads=True)
        assert [kw.get("early_reads", False) for _, kw in calls] == want, calls
