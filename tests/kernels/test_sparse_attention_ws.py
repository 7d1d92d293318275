"""v2 sparse attention kernel (Gluon, ``megamoe/kernels/sparse_attention_ws.py``).

Gluon does not run in the Triton interpreter: on CPU only the selection logic (v1 stays the default; "ws"
falls back to v1 where unsupported) and the offline sm_90 compile are checked. The CUDA tests (skipped here)
compare v2 against the float32 reference with v1's bounds, against v1 itself, and check graph replay == eager
with sync-free launches, for both variants (warp-specialized, and ``MEGAMOE_ATTN_WS=0``).
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megamoe.kernels import sparse_attention as kernels
from megamoe.kernels import sparse_attention_ws as ws_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_sparse_attention import (_graph_check, _v4_inputs, assert_close_to_reference, make_inputs,  # noqa: E402
                                   nan_rows_policy, nan_sink_policy, run_op, run_ref)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_is_ws3_and_env_is_checked(monkeypatch):
    monkeypatch.delenv("MEGAMOE_ATTN_IMPL", raising=False)
    assert kernels.default_impl() == "ws3"  # validated on the H100 (results/attn_v3); v2 stays selectable
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "v1")
    assert kernels.default_impl() == "v1"
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws")
    assert kernels.default_impl() == "ws"
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "v3")
    with pytest.raises(ValueError, match="MEGAMOE_ATTN_IMPL"):
        kernels.default_impl()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter runs CPU tensors (conftest sets it without a GPU)")
def test_ws_falls_back_to_v1_where_unsupported():
    """On the interpreter (or any non-sm_90 / D != 512 case) impl="ws" (v2) and "ws3" (v3) run v1: the same bits."""
    from megamoe.kernels import sparse_attention_ws3 as ws3_kernels

    inputs = make_inputs(N=3)
    outs = []
    for impl in ("v1", "ws", "ws3"):
        out = torch.empty_like(inputs["q"])
        kernels.launch_sparse_mqa_attention(
            inputs["q"], inputs["attn_sink"], inputs["softmax_scale"], inputs["window_kv"], inputs["window_idx"],
            inputs["entries_fp8"], inputs["entries_scale"], inputs["entries_rope"], inputs["block_table"],
            inputs["slots"], inputs["entry_idx"], out, interpreter=True, impl=impl)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="impl"):
        kernels.launch_sparse_mqa_attention(
            inputs["q"], inputs["attn_sink"], inputs["softmax_scale"], inputs["window_kv"], inputs["window_idx"],
            inputs["entries_fp8"], inputs["entries_scale"], inputs["entries_rope"], inputs["block_table"],
            inputs["slots"], inputs["entry_idx"], outs[0], interpreter=True, impl="fast")
    assert not ws_kernels.supports(inputs["q"], 128, 64, 64, 64)
    assert not ws3_kernels.supports(inputs["q"], 512, 448, 64, 64)  # CPU tensor


def test_same_blocks_and_splits_as_v1():
    """The numeric contract: v2 walks v1's BLOCK_N blocks and split layout."""
    assert ws_kernels.WS_CONFIG["BLOCK_N"] == kernels.ATTENTION_CONFIG["BLOCK_N"]
    assert ws_kernels.WS_CONFIG["BLOCK_H"] == kernels.ATTENTION_CONFIG["BLOCK_H"]


def compile_report(**kw):
    """(cuobjdump -res-usage, SASS, PTX, TTGIR, shared bytes) of the v2 sm_90 compile, in a fresh process (the
    test session may run the interpreter)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base = f"/tmp/megamoe_attn_ws_{os.getpid()}_{abs(hash(repr(kw)))}"
    code = ("import sys; from megamoe.kernels.sparse_attention_ws import compile_sm90; "
            f"c = compile_sm90(**{kw!r}); b = sys.argv[1]; open(b + '.cubin', 'wb').write(c.asm['cubin']); "
            "open(b + '.ptx', 'w').write(c.asm['ptx']); open(b + '.ttgir', 'w').write(c.asm['ttgir']); "
            "open(b + '.smem', 'w').write(str(c.metadata.shared))")
    subprocess.run([sys.executable, "-c", code, base], env=env, check=True, timeout=600, cwd=ROOT)
    usage = subprocess.run([tool, "-res-usage", base + ".cubin"], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", base + ".cubin"], capture_output=True, text=True, check=True).stdout
    texts = []
    for ext in (".ptx", ".ttgir", ".smem"):
        with open(base + ext) as f:
            texts.append(f.read())
        os.remove(base + ext)
    os.remove(base + ".cubin")
    return usage, sass, texts[0], texts[1], int(texts[2])


@pytest.mark.slow
@pytest.mark.parametrize("warp_spec", [True, False])
def test_sm90_compile(warp_spec):
    """V4 tiles compile for sm_90 without spills; cp.async gathers; wgmma for S
    (64 x 16 per warpgroup: the score tile split, not
    duplicated) and P.V (64 x 256 per warpgroup); the WS variant has mbarriers, register reallocation and
    partition-local named barriers; shared memory fits one CTA per SM."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("needs cuobjdump (ships with Triton's NVIDIA backend)")
    usage, sass, ptx, ttgir, smem = compile_report(warp_spec=warp_spec)
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack == 0, f"{stack} B of stack: spills"
    assert "HGMMA.64x16x16.F32.BF16" in sass and "HGMMA.64x256x16.F32.BF16" in sass
    assert "HGMMA.64x32x16" not in sass, "a warpgroup computes the whole 64 x 32 score tile (duplicated MMA)"
    assert "warpsPerCTA = [4, 2]" in ttgir
    assert smem <= 227 * 1024
    # gathers are cp.async with a source size (masked rows zero-filled, so a NaN never enters through them)
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10, %r\d+;", ptx)
    if warp_spec:
        assert re.search(r"cp\.async\.wait_group\s+1;", ptx), "the producer keeps one block's gathers in flight"
        assert "mbarrier.try_wait" in ptx and "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
        assert re.search(r"bar\.sync\s+\d+, 128;", ptx), "producer barrier must be partition-local"
        assert re.search(r"bar\.sync\s+\d+, 256;", ptx), "consumer barrier must be partition-local"
    else:
        assert "mbarrier.try_wait" not in ptx


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.fixture
def ws_impl(monkeypatch):
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws")
    return monkeypatch


def _check_vs_v1(inputs, monkeypatch, **kw):
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws")
    got = run_op(inputs, **kw)
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "v1")
    v1 = run_op(inputs, **kw)
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws")
    want = run_ref(inputs)
    assert_close_to_reference(got, want)
    assert_close_to_reference(got, v1)
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 7, 32, 128])
@pytest.mark.parametrize("variant", ["1", "0"])
def test_cuda_v4_flash_csa(N, variant, ws_impl):
    ws_impl.setenv("MEGAMOE_ATTN_WS", variant)
    inputs = _v4_inputs(N, 64, 512)
    _check_vs_v1(inputs, ws_impl)
    _graph_check(inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["1", "0"])
def test_cuda_hca_long_and_v4_pro(variant, ws_impl):
    ws_impl.setenv("MEGAMOE_ATTN_WS", variant)
    inputs = _v4_inputs(2, 64, 1024, context=1024)
    _check_vs_v1(inputs, ws_impl)
    _check_vs_v1(inputs, ws_impl, num_splits=1)
    _graph_check(inputs, num_splits=1)
    _check_vs_v1(_v4_inputs(3, 128, 1024), ws_impl)


def partial_window_inactive_rows_few_entries(check_vs_v1):
    """Windows that end early, queries without rows (row 0), an inactive request (slot -1): ``check_vs_v1(inputs)``
    runs the kernel under test against the reference and v1 and returns its output. Shared with v3's tests."""
    N, W, K = 9, 128, 512
    inputs = _v4_inputs(N, 64, K)
    n = torch.arange(N, device="cuda")[:, None]
    inputs["window_idx"][torch.arange(W, device="cuda")[None, :] >= 14 * n] = -1        # row 0: no window
    inputs["entry_idx"][torch.arange(K, device="cuda")[None, :] >= 50 * n] = -1         # row 0: no entries
    inputs["window_idx"][4].fill_(-1)
    inputs["entry_idx"][4].fill_(-1)
    inputs["slots"][4] = -1                                                              # an inactive row
    got = check_vs_v1(inputs)
    assert torch.equal(got[0].float(), torch.zeros_like(got[0].float()))
    assert torch.equal(got[4].float(), torch.zeros_like(got[4].float()))


def nan_and_out_of_range_flags():
    """A NaN entry stays in the queries that select it; each out-of-range kind sets its error bit (window id, slot,
    entry id past the table, page id past the pool): the kernel of ``MEGAMOE_ATTN_IMPL``. Shared with v3's tests."""
    from megamoe.ops import errors as err

    inputs = make_inputs(N=40, H=64, D=512, rope=64, epb=8, num_pages=20, num_slots=4, pages_per_slot=4, R=50,
                         W=64, K=96, device="cuda")
    inputs["entries_fp8"].view(torch.uint8)[int(inputs["block_table"][0, 0]), 0, 0] = 0x7F
    inputs["window_idx"][:, 0] = 10 ** 6
    inputs["slots"][5] = 99
    inputs["entry_idx"][7, 3] = 10 ** 6            # past the table of a valid slot
    inputs["block_table"][1, 1] = 10 ** 6          # a page id past the pool
    dev = torch.device("cuda")
    err.clear_errors(dev)
    got = run_op(inputs)
    want_flags = (err.flag("sparse_attention", "window_idx") | err.flag("sparse_attention", "slots") |
                  err.flag("sparse_attention", "entry_idx"))
    if bool(((inputs["slots"] == 1)[:, None] & (inputs["entry_idx"] // 8 == 1)).any()):  # that page is looked up
        want_flags |= err.flag("sparse_attention", "block_table")
    assert err.peek_errors(dev) == want_flags
    err.clear_errors(dev)
    assert_close_to_reference(got, run_ref(inputs))
    nan_q = torch.isnan(got.float()).flatten(1).any(dim=1).cpu()
    assert torch.equal(nan_q, torch.isnan(run_ref(inputs).float()).flatten(1).any(dim=1))


@pytest.mark.cuda
def test_cuda_partial_window_inactive_rows_few_entries(ws_impl):
    partial_window_inactive_rows_few_entries(lambda inputs: _check_vs_v1(inputs, ws_impl))


@pytest.mark.cuda
def test_cuda_nan_and_out_of_range_flags(ws_impl):
    nan_and_out_of_range_flags()


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["1", "0"])
def test_cuda_nan_rows_policy(variant, ws_impl):
    """NaN query rows / a NaN selected row (alone in its split too) give NaN, queries without valid rows zeros,
    other rows keep their bits; NaN / -inf sinks (``test_sparse_attention.nan_rows_policy`` / ``nan_sink_policy``)."""
    ws_impl.setenv("MEGAMOE_ATTN_WS", variant)
    nan_rows_policy("cuda", v4=True)
    nan_sink_policy("cuda", v4=True)
