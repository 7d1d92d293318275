"""Split-K of the grouped decode kernel (megamoe/kernels/gemm/nvfp4_mma_decode.py, SPLIT modes; issue 11).

CPU: the host plan (S > 1 only where the host bound on work items leaves the GPU short of programs, every
split non-empty, S = 1 from ~4 tokens), the work / ticket schedule in Python (every output tile written by
exactly one program, the summed splits cover K once and in order, slots unique and inside the workspace,
chunks past the host bound computed whole), the band plan (only the small band splits), and the offline
sm_90 build (registers, no local memory, K-loop SASS per weight within 3% of the unsplit kernel's).

CUDA (the lead's H100 run): V4-Flash / V4-Pro expert shapes at 1, 2, 8 tokens x top-6 (gate_up with the
row_index gather and SwiGLU + clamp, down), split vs S = 1 vs float32; empty experts, one expert holding
every row, padding rows zero, a routing beyond the max_rows_per_expert hint, graph replay == eager with the
routing rewritten in place, sync-free, the two-launch fallback (capture before any eager launch) bit-equal
to the single launch, the row_index guard, tile counters back to zero.

Bound tested between split and S = 1 (both fp32 accumulation, different summation order, one bf16 rounding):
|split - S1| <= 2**-7 * max(|split|, |S1|) + 1e-3 * rms(S1) elementwise (one bf16 ulp plus fp32 order noise).
"""
import os
import random
import subprocess
import sys

import pytest
import torch

from megamoe.kernels.gemm import nvfp4_mma_decode as mma
from megamoe.kernels.gemm.nvfp4_gluon_jit import GLUON_AVAILABLE
from megamoe.ops import gemm as ops_gemm

# (name, H, I, E): V4-Flash and V4-Pro expert shapes; gate_up N = 2I, K = H; down N = H, K = I
V4_SHAPES = [("v4-flash", 4096, 2048, 256), ("v4-pro", 7168, 3072, 384)]
H100_SMS = 132


def _small_band_plan(tokens, experts, k, slots=7):
    plan = ops_gemm.plan_row_bands(slots * tokens, experts + 1, k, tokens)
    return plan[0][1]


@pytest.mark.parametrize("name,h,i,e", V4_SHAPES)
def test_plan_splits_where_the_gpu_is_short_of_programs(name, h, i, e):
    for n, k in ((2 * i, h), (h, i)):
        n_tiles = -(-n // 128)
        for tokens in (1, 2, 4, 8, 16):
            t = 7 * tokens  # top-6 + the fused shared expert (group E)
            items = mma.chunk_bound(t, e + 1, 8, 0, mma.ROW_HI_UNBOUNDED, False, tokens) * n_tiles
            s, per = mma.plan_decode_splits(items, k, 256, H100_SMS)
            k_steps = k // 256
            want_split = items < H100_SMS * mma.DECODE_SPLITK_PROGRAMS_PER_SM
            assert (s > 1) == want_split, (name, n, k, tokens, s)
            assert want_split == (tokens == 1 or (tokens == 2 and name == "v4-flash")), (name, tokens)
            assert (s - 1) * per < k_steps <= s * per  # every split non-empty
            assert per >= min(k_steps, mma.DECODE_SPLITK_MIN_STEPS)
            if s > 1:
                assert items * s >= H100_SMS * mma.DECODE_SPLITK_PROGRAMS_PER_SM
    assert mma.plan_decode_splits(10, 4096, 256, 132, splits=1) == (1, 16)
    assert mma.plan_decode_splits(10, 4096, 256, 132, splits=5) == (4, 4)  # 16 steps: 4 splits of 4
    assert mma.plan_decode_splits(10, 2048, 256, 132, splits=3) == (3, 3)  # 3 + 3 + 2
    assert mma.plan_decode_splits(10, 256, 256, 132, splits=4) == (1, 1)


def test_only_the_small_band_splits(monkeypatch):
    monkeypatch.setattr(ops_gemm, "DECODE_SPLITK", None)  # MEGAMOE_DECODE_SPLITK=1: planned
    for tokens in (1, 2, 8, 16):
        assert _small_band_plan(tokens, 256, 4096)["splits"] is None
    plan = ops_gemm.plan_row_bands(384, 256, 4096, 64)
    assert plan[0][1]["splits"] is None and "splits" not in plan[1][1]  # the 32-row band: no split-K
    monkeypatch.setattr(ops_gemm, "DECODE_SPLITK", 1)  # MEGAMOE_DECODE_SPLITK=0, the default
    assert _small_band_plan(1, 256, 4096)["splits"] == 1


def _routings(e, t, rng):
    yield [0] * e
    yield [t] + [0] * (e - 1)
    yield [1] * min(e, t) + [0] * (e - min(e, t))
    for _ in range(10):
        cut = sorted(rng.randrange(t + 1) for _ in range(e))
        yield [b - a for a, b in zip([0] + cut[:-1], cut)]


@pytest.mark.parametrize("e,t,hint,k_steps,splits", [(257, 7, 1, 16, 3), (257, 14, 2, 8, 3), (4, 40, 1, 28, 2),
                                                      (3, 9, None, 5, 4)])
def test_split_schedule_writes_every_tile_once(e, t, hint, k_steps, splits):
    """Python model of the SPLIT kernels: each (chunk, n-tile) is either summed from `splits` partials
    covering the K steps once, in order, through a unique slot inside the workspace, or written whole
    (padding zeros, chunks past the host bound) by the split-0 program; the counters end at zero."""
    rng = random.Random(t)
    n_tiles = 3
    per = -(-k_steps // splits)
    s = -(-k_steps // per)
    chunks = mma.chunk_bound(t, e, 8, max_rows_per_expert=hint)
    for counts in _routings(e, t, rng):
        offs, acc = [], 0
        for c in counts:
            acc += c
            offs.append(acc)
        items = mma.chunk_schedule_reference(offs, t, 8)
        summed, whole = mma.split_schedule_reference(items, e, n_tiles, s, per, k_steps, chunks)
        written = [(slot // n_tiles, slot % n_tiles) for slot in summed] + whole
        assert sorted(written) == [(c, n) for c in range(len(items)) for n in range(n_tiles)]
        for slot, parts in summed.items():
            assert slot < chunks * n_tiles  # the workspace / counter bound of the launcher
            assert [p[0] for p in parts] == list(range(s))
            covered = [step for _, first, steps in parts for step in range(first, first + steps)]
            assert covered == list(range(k_steps))
        # tickets: whatever the arrival order, exactly one program (the last) reduces, counters end at 0
        counters = {}
        for slot in summed:
            order = list(range(s))
            rng.shuffle(order)
            winners = []
            for split in order:
                ticket = counters.get(slot, 0)
                counters[slot] = ticket + 1
                if ticket == s - 1:
                    winners.append(split)
                    counters[slot] = 0
            assert len(winners) == 1 and counters[slot] == 0


# ----------------------------------------------------------------------------- offline sm_90 build


def _build(split, flags, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / f"split{split}.cubin"
    code = ("import sys; from megamoe.kernels.gemm.nvfp4_mma_decode import compile_for_sm90; "
            f"c = compile_for_sm90((8, 128, 256, 4), split={split}, **{flags!r}); "
            "open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=600)
    return out.read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not GLUON_AVAILABLE, reason="needs Triton with Gluon")
@pytest.mark.parametrize("flags", [dict(row_index=True, swiglu=True), dict(row_index=False, swiglu=False)])
def test_sm90_split_build(tmp_path, flags):
    """Registers no more than the unsplit build (168), no local memory, K-loop SASS per weight within 3% of the
    unsplit kernel's (offline: split 0 3.13 / 3.21, split 1 3.20 / 3.22 per weight)."""
    tk = pytest.importorskip("test_nvfp4_gluon")
    if tk._cuobjdump() is None:
        pytest.skip("needs cuobjdump")
    per_weight, regs = {}, {}
    for split in (0, 1, 2, 3):
        cubin = _build(split, flags, tmp_path)
        path = tmp_path / "res.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([tk._cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True).stdout
        regs[split] = int(res.split("REG:")[1].split()[0])
        assert "STACK:0" in res and "LOCAL:0" in res, res
        loops = [(n, ops) for n, ops in tk._inner_loops(cubin, tmp_path) if ops["HMMA"]]
        if split == 3:  # the reduction-only launch has no K loop
            assert not loops
            continue
        assert len(loops) == 1, loops
        count, ops = loops[0]
        assert not ops["LDL"] and not ops["STL"] and ops["HMMA"] == 32
        per_weight[split] = count / (128 * 256 / 128)
    assert max(regs.values()) <= regs[0] <= 168, regs
    assert per_weight[1] <= 1.03 * per_weight[0] and per_weight[2] <= 1.03 * per_weight[0], per_weight


# ----------------------------------------------------------------------------- CUDA


_WEIGHTS = {}


def _v4_weights(name, h, i, e):
    """(gate_up interleaved (E, 2I, H), down (E, H, I)) of random codes on the GPU, per-expert global scales;
    cached (V4-Pro: ~15 GB)."""
    from gemm_helpers import random_codes_weight

    if name not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        dev = torch.device("cuda")
        _WEIGHTS[name] = (random_codes_weight((e, 2 * i, h), dev, scale_shape=(e, 1, 1)),
                          random_codes_weight((e, h, i), dev, scale_shape=(e, 1, 1)))
    return _WEIGHTS[name]


def _f32_touched(x, w, counts, row_index=None):
    """float32 grouped GEMM on the GPU, decoding only the experts that have rows."""
    from megamoe.format.tensor import NVFP4Tensor
    from megamoe.reference.quantize import dequantize

    xs = x.float() if row_index is None else x.float()[row_index.long()]
    y = torch.zeros(xs.shape[0], w.shape[1], device=x.device)
    start = 0
    for ex, c in enumerate(counts.tolist()):
        if c:
            gs = w.global_scale[ex] if w.global_scale.dim() else w.global_scale
            sub = NVFP4Tensor(w.data[ex], w.block_scale[ex], gs.reshape(()) if gs.numel() == 1 else gs,
                              tuple(w.shape[1:]))
            y[start:start + c] = xs[start:start + c] @ dequantize(sub, torch.float32).t()
        start += c
    return y


def _counts(kind, e, tokens, gen):
    c = torch.zeros(e, dtype=torch.int64)
    if kind == "random":  # distinct top-6 per token
        for _ in range(tokens):
            c[torch.randperm(e, generator=gen)[:6]] += 1
    elif kind == "concentrated":  # every token on the same 6 experts
        c[torch.randperm(e, generator=gen)[:6]] = tokens
    else:  # "one": a single expert holds every row
        c[e // 3] = tokens
    return c


def _close_to_unsplit(a, b):
    a, b = a.float(), b.float()
    bound = 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-3 * b.pow(2).mean().sqrt()
    return bool(((a - b).abs() <= bound).all())


def _grouped(x, w, offsets, out, splits, **kw):
    from megamoe.kernels.gemm.nvfp4_mma_decode import launch_nvfp4_mma_decode

    return launch_nvfp4_mma_decode(x, w.data, w.block_scale, w.global_scale, out, expert_offsets=offsets,
                                   config=mma.select_mma_decode_config(1, x.shape[1]), splits=splits, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("name,h,i,e", V4_SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 8])
@pytest.mark.parametrize("kind", ["random", "concentrated", "one"])
def test_cuda_v4_split_vs_unsplit_vs_float32(name, h, i, e, tokens, kind):
    from gemm_helpers import rel_err
    from megamoe.kernels.gemm.nvfp4_splitk import splitk_counters
    from megamoe.reference.gemm import swiglu_reference

    dev = torch.device("cuda")
    w13, w2 = _v4_weights(name, h, i, e)
    gen = torch.Generator().manual_seed(tokens)
    counts = _counts(kind, e, tokens, gen)
    real = int(counts.sum())
    t = real + 3  # 3 padding rows: zeros
    offsets = counts.cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(tokens, h, device=dev).bfloat16()
    row_index = torch.randint(0, tokens, (t,), device=dev, dtype=torch.int32)
    limit = 10.0
    for proj in ("gate_up", "down"):
        if proj == "gate_up":
            w, xin, n_out, kw = w13, x, i, dict(row_index=row_index, swiglu=True, swiglu_limit=limit)
        else:
            w, n_out, kw = w2, h, {}
            xin = torch.randn(t, i, device=dev).bfloat16()
        outs = {}
        for splits in (1, None, 4):
            out = torch.full((t, n_out), float("nan"), dtype=torch.bfloat16, device=dev)
            outs[splits] = _grouped(xin, w, offsets, out, splits, max_rows_per_expert=tokens, **kw)
        again = _grouped(xin, w, offsets, torch.empty_like(outs[None]), None, max_rows_per_expert=tokens, **kw)
        assert torch.equal(again, outs[None]), "split-K is not deterministic"
        y = _f32_touched(xin, w, counts.to(dev), row_index if proj == "gate_up" else None)
        if proj == "gate_up":  # interleaved rows 2j, 2j+1 = gate j, up j
            y = swiglu_reference(y, limit)
        for splits, out in outs.items():
            assert (out[real:] == 0).all(), f"{proj} S={splits}: padding rows must be 0"
            assert rel_err(out[:real], y[:real]) < 4e-3, (proj, splits)
            assert _close_to_unsplit(out, outs[1]), (proj, splits)
    torch.cuda.synchronize()
    assert int(splitk_counters(dev).count_nonzero()) == 0, "tile counters must be back to 0"


@pytest.mark.cuda
def test_cuda_routing_beyond_the_hint_and_empty():
    """max_rows_per_expert=1 with experts of 2-40 rows and no padding band (own_pad=False): the host bound is
    4 chunks, the routing has 8, so chunks 4..7 are computed whole by split 0 (no slot); no rows at all
    (own_pad=True): only the padding zeros."""
    from gemm_helpers import grouped_f32, random_weight, rel_err

    dev = torch.device("cuda")
    e, n, k = 4, 256, 2048
    w = random_weight((e, n, k), dev, scale_shape=(e, 1, 1))
    counts = [40, 0, 2, 9]
    assert mma.chunk_bound(56, e, 8, own_pad=False, max_rows_per_expert=1) == 4
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(56, k, device=dev).bfloat16()
    out = torch.full((56, n), float("nan"), dtype=torch.bfloat16, device=dev)
    _grouped(x, w, offsets, out, 4, max_rows_per_expert=1, own_pad=False)
    ref = grouped_f32(x, w, offsets).to(dev)
    assert rel_err(out[:51], ref[:51]) < 4e-3
    assert out[51:].isnan().all(), "own_pad=False must leave the padding rows untouched"
    unsplit = _grouped(x, w, offsets, torch.empty_like(out), 1, max_rows_per_expert=1, own_pad=False)
    assert _close_to_unsplit(out[:51], unsplit[:51])
    empty = torch.zeros(e, dtype=torch.int32, device=dev)
    out = torch.full((5, n), float("nan"), dtype=torch.bfloat16, device=dev)
    _grouped(x[:5], w, empty, out, 4, max_rows_per_expert=1)
    assert (out == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("name,h,i,e", V4_SHAPES[:1])
def test_cuda_graph_replay_sync_free_and_fallback(name, h, i, e, monkeypatch):
    """The op at 1 token (planned split-K): sync-free, graph replay == eager after the routing and x are
    rewritten in place; a graph captured before any eager launch (no tile counters yet: partials + a
    reduction launch) replays the same bits as the single-launch eager path."""
    from gemm_helpers import check_sync_free_and_graph
    from megamoe.kernels.gemm import nvfp4_splitk

    dev = torch.device("cuda")
    # planned split-K (MEGAMOE_DECODE_SPLITK=1); the default is off (splits=1) since it measured slower
    monkeypatch.setattr(ops_gemm, "DECODE_SPLITK", None)
    w13, _ = _v4_weights(name, h, i, e)
    tokens, t = 1, 6
    offsets = _counts("random", e, tokens, torch.Generator().manual_seed(3)).cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(tokens, h, device=dev).bfloat16()
    row_index = torch.zeros(t, dtype=torch.int32, device=dev)
    out = torch.empty(t, i, dtype=torch.bfloat16, device=dev)

    def launch():
        return ops_gemm.nvfp4_grouped_mm(x, w13, offsets, row_index=row_index, out=out, activation="swiglu",
                                         swiglu_limit=10.0, max_rows_per_expert=tokens)

    assert ops_gemm.plan_row_bands(t, e, h, tokens)[0][1]["splits"] is None
    launch()  # compile outside the sync check
    new_counts = check_sync_free_and_graph(launch, x, offsets, t)
    assert int(new_counts.sum()) == t
    # capture first: no counters on this device yet -> SPLIT 2 + 3
    monkeypatch.setattr(nvfp4_splitk, "_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, launch()), "two-launch fallback differs from the single launch"
    assert int(nvfp4_splitk.splitk_counters(dev).count_nonzero()) == 0


@pytest.mark.cuda
def test_cuda_row_index_guard_with_split():
    """An out-of-range row_index value is masked (zero input row) and flagged, as without split-K."""
    from gemm_helpers import random_weight
    from megamoe.ops import errors

    dev = torch.device("cuda")
    e, n, k = 8, 256, 2048
    w = random_weight((e, n, k), dev, scale_shape=(e, 1, 1))
    offsets = torch.tensor([0, 3, 3, 3, 5, 5, 5, 6], dtype=torch.int32, device=dev)
    x = torch.randn(4, k, device=dev).bfloat16()
    row_index = torch.tensor([0, 1, 99, 3, 2, 1], dtype=torch.int32, device=dev)
    errors.clear_errors(dev)
    word = errors.error_word(dev)
    split = _grouped(x, w, offsets, torch.empty(6, n, dtype=torch.bfloat16, device=dev), 4, row_index=row_index,
                     error_word=word)
    torch.cuda.synchronize()
    assert errors.peek_errors(dev) != 0, "the bad row_index was not flagged"
    errors.clear_errors(dev)
    unsplit = _grouped(x, w, offsets, torch.empty_like(split), 1, row_index=row_index, error_word=word)
    errors.clear_errors(dev)
    assert _close_to_unsplit(split, unsplit)
