"""Sparse FP8 MQA attention kernel vs the float32 reference.

On CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1) with the interpreter tiles
(BLOCK_H = BLOCK_N = 16), at small shapes (H = 16/24, D = 128, rope = 64, EPB = 4/8) and one D = 512 case; the
offline sm_90 compile of the real tiles is checked for spills. CUDA tests (skipped here) run the V4-Flash /
V4-Pro shapes, graph replay == eager and sync-free launches.

Error bound (:func:`assert_close_to_reference`): ``max |err| <= 1e-2 * max |ref|`` and relative Frobenius error
``<= 4e-3``. The kernel's own error is bf16 rounding of P and of the output (~1e-3 relative); the bound rejects a
wrong block scale or one dropped row (``test_error_bound_rejects_wrong_kernels``).
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megamoe.kernels import sparse_attention as kernels
from megamoe.ops import attention as ops
from megamoe.ops._dispatch import use_triton
from megamoe.reference import attention as ref
from sync_helpers import no_host_syncs
from guard_helpers import require_interpreter, set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)

MAX_TOL = 1e-2
FRO_TOL = 4e-3


def make_inputs(*, N=5, H=16, D=128, rope=64, scale_block=64, epb=4, num_pages=12, num_slots=3, pages_per_slot=3,
                R=24, W=20, K=40, p_invalid=0.2, device="cpu", pow2_scales=True, q_gain=3.0):
    """Random attention inputs (kwargs of the op) with ~p_invalid of the window / entry indices -1."""
    nope = D - rope
    q = (q_gain * torch.randn(N, H, D, device=device)).to(torch.bfloat16)
    sink = torch.randn(H, device=device)
    window_kv = torch.randn(R, D, device=device).to(torch.bfloat16)
    window_idx = torch.randint(0, max(R, 1), (N, W), device=device, dtype=torch.int32)
    window_idx[torch.rand(N, W, device=device) < p_invalid] = -1
    codes = torch.clamp(torch.randn(num_pages, epb, nope, device=device) * 120, -448, 448)
    entries_fp8 = codes.to(torch.float8_e4m3fn)
    nsc = nope // scale_block
    if pow2_scales:  # the official format: power-of-two scales (ue8m0)
        scale = torch.exp2(torch.randint(-9, -6, (num_pages, epb, nsc), device=device).float())
    else:  # one amax / 448-like scale per entry
        scale = torch.rand(num_pages, epb, nsc, device=device) * 0.01 + 1e-3
    entries_rope = torch.randn(num_pages, epb, rope, device=device).to(torch.bfloat16)
    perm = torch.randperm(num_pages, device=device)[: num_slots * pages_per_slot].to(torch.int32)
    block_table = perm.view(num_slots, pages_per_slot).contiguous()
    slots = torch.randint(0, num_slots, (N,), device=device, dtype=torch.int32)
    entry_idx = torch.randint(0, pages_per_slot * epb, (N, K), device=device, dtype=torch.int32)
    entry_idx[torch.rand(N, K, device=device) < p_invalid] = -1
    return dict(q=q, attn_sink=sink, softmax_scale=D ** -0.5, window_kv=window_kv, window_idx=window_idx,
                entries_fp8=entries_fp8, entries_scale=scale, entries_rope=entries_rope, block_table=block_table,
                slots=slots, entry_idx=entry_idx)


def run_op(inputs, **kw):
    args = dict(inputs)
    q, sink, scale = args.pop("q"), args.pop("attn_sink"), args.pop("softmax_scale")
    return ops.sparse_mqa_attention(q, sink, scale, **args, **kw)


def run_ref(inputs):
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    q, sink, scale = args.pop("q"), args.pop("attn_sink"), args.pop("softmax_scale")
    return ref.sparse_mqa_attention(q, sink, scale, **args)


def errors(got, want):
    got, want = got.float().cpu(), want.float().cpu()
    max_err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    fro = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return max_err, fro


def assert_close_to_reference(got, want):
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    zero_rows = (want == 0).all(dim=-1)
    assert torch.equal(got[zero_rows], want[zero_rows]), "queries without valid rows must be exact zeros"
    got, want = got[~nan], want[~nan]
    if want.numel() == 0 or want.abs().max() == 0:
        assert torch.equal(got, want)
        return
    max_err, fro = errors(got, want)
    assert max_err <= MAX_TOL and fro <= FRO_TOL, (
        f"max err {max_err:.2e} (tol {MAX_TOL}), fro {fro:.2e} (tol {FRO_TOL})")


def check(inputs, **kw):
    assert use_triton(inputs["q"]), "kernel tests must run the Triton path"
    got = run_op(inputs, **kw)
    assert got.dtype == torch.bfloat16 and got.shape == inputs["q"].shape
    want = run_ref(inputs)
    assert_close_to_reference(got, want)
    return got, want


# ----------------------------------------------------------------------------------------------- CPU / interpreter
@pytest.mark.parametrize("scale_block,pow2", [(64, True), (32, True), (64, False)])
def test_random_matches_reference(scale_block, pow2, device):
    inputs = make_inputs(scale_block=scale_block, pow2_scales=pow2, device=device)
    check(inputs)


def test_per_entry_scale_layout(device):
    """One scale per entry (SB = nope) with non-power-of-two scales (the bf16 rounding of fp8 * scale matters)."""
    inputs = make_inputs(D=192, rope=64, scale_block=128, pow2_scales=False, epb=8, num_pages=6, pages_per_slot=2,
                         device=device)
    check(inputs)


def test_split_kv_on_and_off_agree(device):
    """Every split count matches the reference and the unsplit run. Not bit-equal: P is rounded to bf16
    relative to each split's own running max, so splits change P's rounding (~2**-9 relative per weight;
    observed: max 2.5e-3, Frobenius 1.4e-3 between split counts). The same split count is bit-reproducible."""
    inputs = make_inputs(N=3, W=40, K=70, device=device)
    blocks = 3 + 5
    outs = {s: run_op(inputs, num_splits=s).float().cpu() for s in (1, 2, 3, blocks)}
    want = run_ref(inputs)
    for s, got in outs.items():
        assert_close_to_reference(got, want)
        assert_close_to_reference(got, outs[1])
    again = run_op(inputs, num_splits=3).float().cpu()
    assert torch.equal(again, outs[3]), "split-KV is not deterministic"


def test_all_invalid_gives_zeros(device):
    inputs = make_inputs(device=device)
    inputs["window_idx"].fill_(-1)
    inputs["entry_idx"].fill_(-1)
    for splits in (1, 4):
        out = run_op(inputs, num_splits=splits)
        assert torch.equal(out.float().cpu(), torch.zeros(out.shape))


def test_mixed_counts_partial_window_few_entries(device):
    """Row n keeps n valid window rows and 3n valid entries (row 0 has none): fewer valid entries than K,
    window not full, different counts per row, one query without rows."""
    N, W, K = 6, 20, 40
    inputs = make_inputs(N=N, W=W, K=K, p_invalid=0.0, device=device)
    cols_w = torch.arange(W, device=device)[None, :]
    cols_k = torch.arange(K, device=device)[None, :]
    n = torch.arange(N, device=device)[:, None]
    inputs["window_idx"][cols_w >= n] = -1
    inputs["entry_idx"][torch.roll(cols_k >= 3 * n, shifts=2, dims=1)] = -1  # not a prefix: holes anywhere
    got, want = check(inputs)
    assert torch.equal(got[0].float().cpu(), torch.zeros_like(want[0].float()))


@pytest.mark.parametrize("W,K", [(0, 40), (20, 0), (0, 0), (1, 1), (16, 16)])
def test_empty_or_small_sets(W, K, device):
    inputs = make_inputs(W=W, K=K, device=device)
    check(inputs)


def test_heads_and_tokens_not_multiples_of_tiles(device):
    inputs = make_inputs(N=7, H=24, W=17, K=33, device=device)
    check(inputs)


def test_out_buffer_is_written(device):
    inputs = make_inputs(device=device)
    out = torch.full(inputs["q"].shape, 7.0, dtype=torch.bfloat16, device=device)
    got = run_op(inputs, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close_to_reference(out, run_ref(inputs))


def test_nan_entry_stays_confined(device):
    """A NaN in one entry (an FP8 NaN byte; a NaN scale) reaches only the queries that select that entry."""
    N = 6
    inputs = make_inputs(N=N, p_invalid=0.0, device=device)
    table, epb = inputs["block_table"], inputs["entries_fp8"].shape[1]
    slots, idx = inputs["slots"], inputs["entry_idx"]
    slot_a = int(slots[0])
    slot_b = (slot_a + 1) % table.shape[0]
    entry_a = 1 * epb + 2                                        # logical entry of slot_a: page 1, row 2
    inputs["entries_fp8"].view(torch.uint8)[int(table[slot_a, 1]), 2, 5] = 0x7F   # e4m3 NaN
    inputs["entries_scale"][int(table[slot_b, 0]), 0, 0] = float("nan")           # entry 0 of slot_b
    later = (torch.arange(N, device=device) > 0)[:, None]
    idx[(slots == slot_a)[:, None] & later & (idx == entry_a)] = -1   # only query 0 selects entry_a ...
    idx[0, 3] = entry_a                                               # ... and it does
    got, want = check(inputs)
    nan_q = torch.isnan(got.float().cpu()).flatten(1).any(dim=1)
    expect = ((slots == slot_b)[:, None] & (idx == 0)).any(dim=1).cpu()
    expect[0] = True
    assert torch.equal(nan_q, expect)
    assert torch.isnan(got[0].float()).all(), "every head of the selecting query is NaN"


def _nan_rows_inputs(device, v4=False):
    """(clean inputs, the same with NaNs): every 16th window / entry id is -1, so that every row block (16, 32 or
    64 rows) has a masked row. Query 0, 6, 7: clean; 1: head 5's q row NaN, one NaN element in head 9's; 2: its
    only valid row is window row r0, which has a NaN (so with ``num_splits > 1`` the other splits are empty); 3:
    r0 among valid window rows and entries; 4: no valid row and an all-NaN q; 5: no valid row, slot -1. No other
    query selects r0.

    Why the masked rows: on the GPU ``max`` ignores NaN, so a block whose valid scores are all NaN keeps
    ``m = -inf`` while ``l`` and the accumulator are NaN; the interpreter's ``tl.max`` (``np.nanmax``) does the
    same only when the block also has a finite or ``-inf`` score (an all-NaN slice gives NaN)."""
    if v4:
        clean = make_inputs(N=8, H=64, D=512, rope=64, epb=8, num_pages=20, num_slots=4, pages_per_slot=4, R=50,
                            W=64, K=96, p_invalid=0.0, device=device)
    else:
        clean = make_inputs(N=8, H=16, W=20, K=40, p_invalid=0.0, device=device)
    widx, eidx = clean["window_idx"], clean["entry_idx"]
    widx[:, ::16] = -1
    eidx[:, ::16] = -1
    r0 = 3
    widx[widx == r0] = r0 + 1
    widx[2] = -1
    widx[2, 1] = r0
    eidx[2] = -1
    widx[3, 1] = r0
    widx[4:6] = -1
    eidx[4:6] = -1
    clean["slots"][5] = -1
    nan = dict(clean, q=clean["q"].clone(), window_kv=clean["window_kv"].clone())
    nan["q"][1, 5] = float("nan")
    nan["q"][1, 9, 3] = float("nan")
    nan["q"][4] = float("nan")
    nan["window_kv"][r0, 7] = float("nan")
    return clean, nan


def nan_rows_policy(device, v4=False, splits=(1, 3, None)):
    """The NaN policy of the kernel that ``run_op`` runs (``MEGAMOE_ATTN_IMPL``), as the reference's: a NaN in a
    query's q row or in a row it selects gives NaN (the whole (query, head) row), also when that row is the
    query's only valid one, alone in its split; a query without valid rows gives zeros, whatever its q (NaN
    included); every other output row keeps its bits. Shared with the v2 / v3 tests (``v4``: V4's row)."""
    clean, nan = _nan_rows_inputs(device, v4)
    want = run_ref(nan)
    H = clean["q"].shape[1]
    nan_rows = torch.zeros(clean["q"].shape[:2], dtype=torch.bool)
    nan_rows[1, 5] = nan_rows[1, 9] = True
    nan_rows[2:4] = True
    assert torch.equal(torch.isnan(want.float()).all(dim=-1), nan_rows)
    assert torch.equal(torch.isnan(want.float()).any(dim=-1), nan_rows)
    for num_splits in splits:
        base = run_op(clean, num_splits=num_splits).float().cpu()
        got = run_op(nan, num_splits=num_splits).float().cpu()
        rows = torch.isnan(got).all(dim=-1)
        assert torch.equal(rows, nan_rows), (f"num_splits={num_splits}: NaN (query, head) rows "
                                             f"{rows.nonzero().tolist()}, want {nan_rows.nonzero().tolist()}")
        assert torch.equal(torch.isnan(got).any(dim=-1), nan_rows), f"num_splits={num_splits}: partly NaN rows"
        assert torch.equal(got[4:6], torch.zeros(2, H, got.shape[-1])), "no valid row -> zeros"
        assert torch.equal(got[~nan_rows].view(torch.int32), base[~nan_rows].view(torch.int32)), \
            f"num_splits={num_splits}: a row without NaN changed"
        assert_close_to_reference(got, want)


def nan_sink_policy(device, v4=False, splits=(1, 3, None)):
    """A NaN sink gives NaN in its head for every query with valid rows, a -inf sink drops out of the denominator;
    queries without valid rows stay zeros for both (the reference's policy: zeros where nothing is valid)."""
    clean, _ = _nan_rows_inputs(device, v4)
    clean["attn_sink"][2] = float("nan")
    clean["attn_sink"][4] = float("-inf")
    want = run_ref(clean)
    for num_splits in splits:
        got = run_op(clean, num_splits=num_splits)
        assert_close_to_reference(got, want)
        got = got.float().cpu()
        assert torch.isnan(got[[0, 1, 2, 3, 6, 7], 2]).all()
        assert not torch.isnan(got[:, 4]).any()
        assert torch.equal(got[4:6], torch.zeros_like(got[4:6]))


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_nan_query_or_row_gives_nan_row(num_splits, device):
    """v1 (the interpreter's kernel), unsplit and through the split combine: NaN in, NaN out (it gave zeros: the
    finalisation zeroed every row whose running max stayed -inf, and a NaN score never raises the max)."""
    nan_rows_policy(device, splits=(num_splits,))


def test_nan_sink_and_rows_without_entries(device):
    nan_sink_policy(device)


def test_out_of_range_indices_are_skipped(device):
    """Out-of-range window ids, entry ids past the block table, pages outside the pool and slots outside the
    table give exactly the output of the same inputs with those indices set to -1."""
    inputs = make_inputs(N=6, p_invalid=0.0, device=device)
    R, P = inputs["window_kv"].shape[0], inputs["entries_fp8"].shape[0]
    S, L = inputs["block_table"].shape
    epb = inputs["entries_fp8"].shape[1]
    bad = dict(inputs)
    bad["window_idx"] = inputs["window_idx"].clone()
    bad["window_idx"][:, 0] = R
    bad["window_idx"][:, 1] = -7
    bad["window_idx"][1, 2] = 2 ** 30
    bad["entry_idx"] = inputs["entry_idx"].clone()
    bad["entry_idx"][:, 0] = L * epb          # logical page L: past the table
    bad["entry_idx"][:, 1] = -3
    bad["entry_idx"][2, 2] = 2 ** 31 - 1
    bad["block_table"] = inputs["block_table"].clone()
    bad["block_table"][0, 2] = P              # page outside the pool
    bad["block_table"][1, 1] = -5
    bad["block_table"][2, 0] = 2 ** 31 - 1
    bad["slots"] = inputs["slots"].clone()
    bad["slots"][3] = S
    bad["slots"][4] = -2

    clean = dict(inputs)
    clean["window_idx"] = bad["window_idx"].clone()
    clean["window_idx"][(clean["window_idx"] < 0) | (clean["window_idx"] >= R)] = -1
    e = bad["entry_idx"].long()
    slot = bad["slots"].long()[:, None].expand_as(e)
    slot_ok = (slot >= 0) & (slot < S)
    lp = torch.where(e >= 0, e // epb, 0)
    page = torch.where(slot_ok & (e >= 0) & (lp < L),
                       bad["block_table"].long()[slot.clamp(0, S - 1), lp.clamp(0, L - 1)],
                       torch.full_like(e, -1))
    clean["entry_idx"] = torch.where((page >= 0) & (page < P), e, -1).to(torch.int32)
    clean["block_table"] = inputs["block_table"]
    clean["slots"] = inputs["slots"]
    for splits in (1, 3):
        got_bad = run_op(bad, num_splits=splits)
        got_clean = run_op(clean, num_splits=splits)
        assert torch.equal(got_bad.view(torch.int16), got_clean.view(torch.int16))
    assert_close_to_reference(got_bad, run_ref(bad))
    assert_close_to_reference(got_bad, run_ref(clean))


def test_repeated_index_counts_twice(device):
    inputs = make_inputs(N=2, W=4, K=4, p_invalid=0.0, device=device)
    inputs["entry_idx"][:, 1] = inputs["entry_idx"][:, 0]
    check(inputs)


@pytest.mark.slow
def test_v4_head_dim(device):
    """D = 512 (nope 448 = 7 scale blocks of 64, rope 64): the V4 entry format, 8 chunks of 64."""
    inputs = make_inputs(N=2, H=16, D=512, rope=64, scale_block=64, epb=8, num_pages=10, pages_per_slot=3,
                         R=40, W=24, K=40, device=device)
    check(inputs)


def test_error_bound_rejects_wrong_kernels(device):
    """The bound is sharp: a wrong block scale, or one dropped row per query, fails it."""
    inputs = make_inputs(N=6, W=3, K=5, p_invalid=0.0, device=device)
    want = run_ref(inputs)
    wrong_scale = dict(inputs, entries_scale=inputs["entries_scale"].clone())
    wrong_scale["entries_scale"][..., 0] *= 2
    dropped = dict(inputs, entry_idx=inputs["entry_idx"].clone())
    dropped["entry_idx"][:, 0] = -1
    for bad in (wrong_scale, dropped):
        with pytest.raises(AssertionError):
            assert_close_to_reference(run_ref(bad), want)
    check(inputs)


def test_split_choice_depends_on_shapes_only():
    s1 = kernels.choose_num_splits(1, 64, 128, 1024)
    assert s1 == kernels.choose_num_splits(1, 64, 128, 1024) and s1[0] > 1
    assert kernels.choose_num_splits(128, 64, 128, 512)[0] == 1
    for n in (1, 3, 8, 32, 64):
        for w, k in ((128, 512), (128, 1024), (0, 7), (5, 0)):
            splits, per = kernels.choose_num_splits(n, 64, w, k)
            blocks = -(-w // 32) + -(-k // 32)
            assert splits * per >= blocks and (splits - 1) * per < max(blocks, 1)
            assert n * splits <= max(kernels.SPLIT_TARGET_PROGRAMS, n)


# ----------------------------------------------------------------------------------------------- offline sm_90
def _compile_report(**kw) -> str:
    """cuobjdump resource usage + SASS of the sm_90 compile, in a fresh process (the test session may run the
    interpreter, which replaces jit functions and cannot compile)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, subprocess; from megamoe.kernels.sparse_attention import compile_sm90; "
            f"c = compile_sm90(**{kw!r}); open(sys.argv[1], 'wb').write(c.asm['cubin'])")
    path = f"/tmp/megamoe_attn_{os.getpid()}_{abs(hash(repr(kw)))}.cubin"
    subprocess.run([sys.executable, "-c", code, path], env=env, check=True, timeout=600,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    os.remove(path)
    return usage, sass


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_sm90_compile_registers_and_loop(split):
    """V4 tiles compile for sm_90: <= 255 registers, a small stack, tensor-core (HGMMA) MMAs, no stores to
    the stack inside the main loop (spill reloads are bounded)."""
    import shutil
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("needs cuobjdump (ships with Triton's NVIDIA backend)")
    del shutil
    usage, sass = _compile_report(split=split)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert regs <= 255
    assert stack <= 512, f"stack {stack} B: spills grew (280 B at the time of writing)"
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(t.group(1), 16), a) for a, s in code for t in [re.search(r"BRA (0x[0-9a-f]+)", s)]
             if t and int(t.group(1), 16) < a]
    assert loops, "no loop found"
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    body = [s for a, s in code if lo <= a <= hi]
    assert sum("HGMMA" in s for s in body) >= 2
    # the device guard's per-lane error code (megamoe/ops/errors.py) costs one stack store in the loop (280 B of
    # stack, 40 more SASS instructions per iteration); MEGAMOE_DEVICE_GUARD=0 compiles it out: 0 stores, 264 B
    stores = sum(s.split()[0].startswith("STL") or " STL" in s for s in body)
    assert stores <= 1, f"{stores} stores to the stack in the loop"
    assert sum("LDL" in s for s in body) <= 32


# ----------------------------------------------------------------------------------------------- CUDA
def _graph_check(inputs, **kw):
    """Sync-free eager call, CUDA-graph capture, inputs rewritten in place, replay == eager bit for bit."""
    out = torch.empty_like(inputs["q"])
    ws = ops.attention_workspace(inputs["q"].shape[0], inputs["q"].shape[1], inputs["q"].shape[2],
                                 inputs["window_idx"].shape[1], inputs["entry_idx"].shape[1], inputs["q"].device,
                                 num_splits=kw.get("num_splits"))
    torch.cuda.synchronize()
    with no_host_syncs():
        run_op(inputs, out=out, workspace=ws, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(inputs, out=out, workspace=ws, **kw)
    fresh = make_inputs(N=inputs["q"].shape[0], H=inputs["q"].shape[1], D=inputs["q"].shape[2],
                        epb=inputs["entries_fp8"].shape[1], num_pages=inputs["entries_fp8"].shape[0],
                        num_slots=inputs["block_table"].shape[0], pages_per_slot=inputs["block_table"].shape[1],
                        R=inputs["window_kv"].shape[0], W=inputs["window_idx"].shape[1],
                        K=inputs["entry_idx"].shape[1], device=inputs["q"].device)
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor):
            t.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, run_op(inputs, **kw)), "CUDA-graph replay differs from eager"
    assert_close_to_reference(replayed, run_ref(inputs))


def _v4_inputs(N, H, K, W=128, epb=64, context=None):
    entries = max(K, 1) * 2 if context is None else context
    pages_per_slot = -(-entries // epb)
    slots = min(max(N, 1), 16)  # queries share slots beyond 16 (keeps the CPU reference's pool small)
    inputs = make_inputs(N=N, H=H, D=512, rope=64, scale_block=64, epb=epb, num_pages=slots * pages_per_slot + 3,
                         num_slots=slots, pages_per_slot=pages_per_slot, R=slots * W + 1, W=W, K=K, p_invalid=0.05,
                         device="cuda", q_gain=1.0)
    return inputs


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 2, 7, 32, 64])
def test_cuda_v4_flash_shapes(N):
    inputs = _v4_inputs(N, 64, 512)
    check(inputs)
    _graph_check(inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("N,K", [(1, 1024), (9, 1024), (16, 1024)])
def test_cuda_v4_pro_shapes(N, K):
    inputs = _v4_inputs(N, 128, K)
    check(inputs)
    _graph_check(inputs)


@pytest.mark.cuda
def test_cuda_hca_long_set_split_kv():
    """HCA at 128k context, batch 1: 1024 entries + window, split-KV on (auto) and off agree."""
    inputs = _v4_inputs(1, 64, 1024, context=1024)
    auto = run_op(inputs).float()
    one = run_op(inputs, num_splits=1).float()
    # P is rounded to bf16 against each split's own running max, so the two differ by bf16 noise, not more
    assert float((auto - one).norm() / one.norm()) < 4e-3
    assert torch.equal(run_op(inputs).float(), auto)
    check(inputs)
    _graph_check(inputs, num_splits=1)


@pytest.mark.cuda
def test_cuda_prefill_chunk():
    inputs = _v4_inputs(300, 64, 512)
    check(inputs)


@pytest.mark.cuda
def test_cuda_nan_and_out_of_range():
    inputs = make_inputs(N=40, H=64, D=512, rope=64, epb=8, num_pages=20, num_slots=4, pages_per_slot=4, R=50,
                         W=64, K=96, device="cuda")
    inputs["entries_fp8"].view(torch.uint8)[int(inputs["block_table"][0, 0]), 0, 0] = 0x7F
    inputs["window_idx"][:, 0] = 10 ** 6
    inputs["entry_idx"][:, 1] = 10 ** 6
    inputs["slots"][5] = 99
    check(inputs)


@pytest.mark.cuda
def test_cuda_nan_rows_policy(monkeypatch):
    """v1 with V4's row on the GPU (split combine included): NaN query rows / a NaN selected row give NaN, queries
    without valid rows zeros, other rows unchanged (``nan_rows_policy``, ``nan_sink_policy``; v2 / v3: their
    test files)."""
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "v1")
    nan_rows_policy("cuda", v4=True)
    nan_sink_policy("cuda", v4=True)


# ----------------------------------------------------------------------------------------------- error word
def _flag(arg):
    from megamoe.ops import errors as err
    return err.flag("sparse_attention", arg)


def _bad_case(kind, inputs):
    """A copy of ``inputs`` with one out-of-range index of ``kind``; returns (inputs, expected flags)."""
    bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    R, P = inputs["window_kv"].shape[0], inputs["entries_fp8"].shape[0]
    S, L = inputs["block_table"].shape
    epb = inputs["entries_fp8"].shape[1]
    if kind == "none_markers":  # -1 everywhere it is legitimate: no flag
        bad["window_idx"][0, :3] = -1
        bad["entry_idx"][1, :3] = -1
        bad["slots"][2] = -1
        bad["block_table"][int(bad["slots"][0]), 0] = -1
        return bad, 0
    if kind == "window_high":
        bad["window_idx"][1, 2] = R
        return bad, _flag("window_idx")
    if kind == "window_negative":
        bad["window_idx"][0, -1] = -2
        return bad, _flag("window_idx")
    if kind == "entry_past_table":
        bad["entry_idx"][0, 0] = L * epb
        bad["slots"][0] = 0
        return bad, _flag("entry_idx")
    if kind == "entry_negative":
        bad["entry_idx"][3, -1] = -5
        bad["slots"][3] = 1
        return bad, _flag("entry_idx")
    if kind == "slot_high":  # its entries are skipped, not flagged as entries
        bad["slots"][2] = S
        bad["entry_idx"][2, 0] = 10 ** 6
        return bad, _flag("slots")
    if kind == "slot_negative":
        bad["slots"][4] = -3
        return bad, _flag("slots")
    if kind in ("page_high", "page_negative"):
        bad["slots"][1] = 0
        bad["entry_idx"][1, 0] = 0  # logical page 0 of slot 0 is looked up
        bad["block_table"][0, 0] = P if kind == "page_high" else -4
        return bad, _flag("block_table")
    raise AssertionError(kind)


KINDS = ["none_markers", "window_high", "window_negative", "entry_past_table", "entry_negative", "slot_high",
         "slot_negative", "page_high", "page_negative"]


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_flags_both_backends(kind, monkeypatch):
    """Each out-of-range kind sets exactly its bit on the kernel path (interpreter, split and unsplit) and on the
    torch path; -1 markers set none; the skipped indices change nothing else (kernel == reference)."""
    from megamoe.ops import errors as err

    inputs = make_inputs(N=6, p_invalid=0.1, num_slots=3, pages_per_slot=3)
    bad, expected = _bad_case(kind, inputs)
    words = []
    for interp, splits in (("1", 1), ("1", 3), ("0", None)):
        set_interpret(monkeypatch, interp)
        err.clear_errors("cpu")
        got = run_op(bad, num_splits=splits) if splits else run_op(bad)
        words.append(err.peek_errors("cpu"))
        assert_close_to_reference(got, run_ref(bad))
    err.clear_errors("cpu")
    assert words == [expected] * 3, (kind, words)
    if expected:
        set_interpret(monkeypatch, "1")
        run_op(bad)
        with pytest.raises(err.DeviceIndexError, match=r"sparse_attention: argument"):
            err.check_errors("cpu")


def test_flag_set_by_the_kernel_not_only_the_op():
    """The launcher itself flags (a given word), so the Triton path does not rely on the op's torch checks."""
    require_interpreter()  # CPU tensors through the interpreter's kernel
    inputs = make_inputs(N=3)
    inputs["window_idx"][0, 0] = 10 ** 6
    inputs["block_table"][0, 0] = 2 ** 31 - 1
    inputs["slots"][0] = 0
    inputs["entry_idx"][0, 0] = 0
    word = torch.zeros(1, dtype=torch.int32)
    out = torch.empty_like(inputs["q"])
    kernels.launch_sparse_mqa_attention(
        inputs["q"], inputs["attn_sink"], inputs["softmax_scale"], inputs["window_kv"], inputs["window_idx"],
        inputs["entries_fp8"], inputs["entries_scale"], inputs["entries_rope"], inputs["block_table"],
        inputs["slots"], inputs["entry_idx"], out, interpreter=True, error_word=word)
    assert int(word) == _flag("window_idx") | _flag("block_table")


@pytest.mark.cuda
def test_cuda_out_of_range_flags_eager_and_graph():
    """V4 shapes on the GPU: every kind sets its bit without a host sync, inside a graph replay too; the output
    equals the output with the bad indices replaced by -1."""
    from megamoe.ops import errors as err

    dev = torch.device("cuda")
    err.error_word(dev)
    for kind in KINDS:
        inputs = make_inputs(N=8, H=64, D=512, rope=64, epb=8, num_pages=20, num_slots=4, pages_per_slot=4, R=50,
                             W=64, K=96, device="cuda")
        bad, expected = _bad_case(kind, inputs)
        err.clear_errors(dev)
        torch.cuda.synchronize()
        with no_host_syncs():
            eager = run_op(bad)
        assert err.peek_errors(dev) == expected, kind
        assert_close_to_reference(eager, run_ref(bad))
        err.clear_errors(dev)
        out = torch.empty_like(eager)
        ws = ops.attention_workspace(8, 64, 512, 64, 96, dev)
        run_op(bad, out=out, workspace=ws)
        err.clear_errors(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_op(bad, out=out, workspace=ws)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), kind
        if expected:
            with pytest.raises(err.DeviceIndexError, match="sparse_attention"):
                err.check_errors(dev)
        else:
            err.check_errors(dev)


@pytest.mark.parametrize("interp", ["1", "0"])
def test_slot_not_flagged_without_entries(interp, monkeypatch):
    """K = 0 (window-only layers pass a (1, 1) dummy table): the slot addresses nothing and is not flagged."""
    from megamoe.ops import errors as err

    set_interpret(monkeypatch, interp)
    inputs = make_inputs(N=3, K=0, num_slots=1, pages_per_slot=1)
    inputs["slots"] = torch.tensor([0, 5, 7], dtype=torch.int32)
    err.clear_errors("cpu")
    run_op(inputs)
    assert err.peek_errors("cpu") == 0
