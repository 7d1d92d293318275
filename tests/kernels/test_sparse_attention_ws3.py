"""v3 sparse attention kernel (Gluon, ``megamoe/kernels/sparse_attention_ws3.py``): three warpgroups, 64-row blocks.

Gluon does not run in the Triton interpreter: on CPU the selection and split logic, the interpreter fallback and
the offline sm_90 compile are checked. The CUDA tests (skipped here) compare v3 against the float32 reference and
v1 with the bounds of ``test_sparse_attention.py``, against the reference's bf16-P mirror with 64-row blocks (the
numeric contract), on edge cases (partial windows, inactive rows, few entries, NaN entries, out-of-range
indices), and check graph replay == eager with sync-free launches.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megamoe.kernels import sparse_attention as kernels
from megamoe.kernels import sparse_attention_ws3 as ws3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_sparse_attention import (_graph_check, _v4_inputs, assert_close_to_reference,  # noqa: E402
                                   nan_rows_policy, nan_sink_policy, run_op, run_ref)
from test_sparse_attention_bf16p import _assert_mirrors, _mirror  # noqa: E402
from test_sparse_attention_ws import nan_and_out_of_range_flags, partial_window_inactive_rows_few_entries  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_block_rows_and_split_layout():
    """v3 walks 64-row blocks; its split count never exceeds the 32-row count that sizes the workspace
    (``ops.attention.attention_workspace``)."""
    assert ws3.WS3_CONFIG["BLOCK_N"] == 64 and ws3.WS3_CONFIG["BLOCK_H"] == kernels.ATTENTION_CONFIG["BLOCK_H"]
    assert kernels.main_block_n("ws3") == 64
    assert kernels.main_block_n("ws") == kernels.main_block_n("v1") == kernels.ATTENTION_CONFIG["BLOCK_N"]
    assert kernels.main_block_n("ws3", interpreter=True) == kernels.INTERPRETER_CONFIG["BLOCK_N"]
    # other rows (e.g. the tiny test model's head_dim 128) run v2 / v1 with their 32-row blocks
    assert kernels.main_block_n("ws3", head_dim=128) == kernels.ATTENTION_CONFIG["BLOCK_N"]
    assert kernels.main_block_n("ws3", scale_block=448) == kernels.ATTENTION_CONFIG["BLOCK_N"]
    for n in (1, 2, 7, 8, 16, 32, 33, 64, 128, 129):
        for w in (0, 1, 64, 128):
            for k in (0, 1, 63, 64, 512, 1024, 1152):
                s64, per64 = kernels.choose_num_splits(n, 64, w, k, block_n=64)
                s32, _ = kernels.choose_num_splits(n, 64, w, k)
                assert 1 <= s64 <= s32
                blocks = -(-w // 64) + -(-k // 64)
                assert s64 == max(1, -(-max(blocks, 1) // per64))


def compile_report(**kw):
    """(cuobjdump -res-usage, SASS, PTX, shared bytes) of the v3 sm_90 compile, in a fresh process."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base = f"/tmp/megamoe_attn_ws3_{os.getpid()}_{abs(hash(repr(kw)))}"
    code = ("import sys; from megamoe.kernels.sparse_attention_ws3 import compile_sm90; "
            f"c = compile_sm90(**{kw!r}); b = sys.argv[1]; open(b + '.cubin', 'wb').write(c.asm['cubin']); "
            "open(b + '.ptx', 'w').write(c.asm['ptx']); open(b + '.smem', 'w').write(str(c.metadata.shared))")
    subprocess.run([sys.executable, "-c", code, base], env=env, check=True, timeout=600, cwd=ROOT)
    usage = subprocess.run([tool, "-res-usage", base + ".cubin"], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", base + ".cubin"], capture_output=True, text=True, check=True).stdout
    with open(base + ".ptx") as f:
        ptx = f.read()
    with open(base + ".smem") as f:
        smem = int(f.read())
    for ext in (".cubin", ".ptx", ".smem"):
        os.remove(base + ext)
    return usage, sass, ptx, smem


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_sm90_compile(split):
    """The V4 tile compiles for sm_90: the score warpgroup's 64 x 64 S and both 64 x 256 P.V wgmmas, register
    reallocation for three roles, 16-byte FP8 loads and L2 prefetches in the producer, and at most a few spilled
    words (setup values, none in the loops); one CTA per SM."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("needs cuobjdump (ships with Triton's NVIDIA backend)")
    usage, sass, ptx, smem = compile_report(split=split)
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack <= 32, f"{stack} B of stack"
    assert "HGMMA.64x64x16.F32.BF16" in sass and "HGMMA.64x256x16.F32.BF16" in sass
    assert "HGMMA.64x16x16" not in sass and "HGMMA.64x32x16" not in sass
    assert "LDG.E.128" in sass and "CCTL.E.PF2" in sass
    regs = sorted(int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert ws3.WS3_CONFIG["VALUE_REGS"] in regs and ws3.WS3_CONFIG["PRODUCER_REGS"] in regs
    assert "mbarrier.try_wait" in ptx
    assert smem <= 227 * 1024


@pytest.mark.slow
def test_sm90_compile_chunked_kv():
    """``KV_CHUNKS = 8`` (one shared allocation per 64-column chunk of a K/V stage): Triton's hazard pass no longer
    puts a ``bar.sync`` between the producer's dequantised chunk stores (13 among them with one allocation, at most
    2 here); S and P.V run as 64 x 64 wgmmas; one CTA per SM. The score warpgroup spills a few words more than
    with one allocation (80 B of stack at Triton 3.6, some reloaded in its loop: 8 + 4 chunk descriptors)."""
    def barriers_among_dequant_stores(ptx):
        first, last = ptx.index("cvt.rn.f16x2.e4m3x2"), ptx.rindex("cvt.rn.f16x2.e4m3x2")
        return len(re.findall(r"bar\.sync\s+\d+, 128;", ptx[first:last]))

    usage, sass, ptx, smem = compile_report(config={"KV_CHUNKS": 8})
    _, _, ptx_one, _ = compile_report()
    assert barriers_among_dequant_stores(ptx_one) >= 12
    assert barriers_among_dequant_stores(ptx) <= 2
    assert "HGMMA.64x64x16.F32.BF16" in sass and "HGMMA.64x256x16" not in sass
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 96
    assert smem <= 227 * 1024


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.fixture
def ws3_impl(monkeypatch):
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws3")
    return monkeypatch


def _check_vs_v1(inputs, monkeypatch, **kw):
    got = run_op(inputs, **kw)
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "v1")
    v1 = run_op(inputs, **kw)
    monkeypatch.setenv("MEGAMOE_ATTN_IMPL", "ws3")
    assert_close_to_reference(got, run_ref(inputs))
    assert_close_to_reference(got, v1)
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 7, 32, 128])
def test_cuda_v4_flash_csa(N, ws3_impl):
    inputs = _v4_inputs(N, 64, 512)
    _check_vs_v1(inputs, ws3_impl)
    _graph_check(inputs)


@pytest.mark.cuda
def test_cuda_hca_long_and_v4_pro(ws3_impl):
    inputs = _v4_inputs(2, 64, 1024, context=1024)
    _check_vs_v1(inputs, ws3_impl)
    _check_vs_v1(inputs, ws3_impl, num_splits=1)
    _graph_check(inputs, num_splits=1)
    _check_vs_v1(_v4_inputs(3, 128, 1024), ws3_impl)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_cuda_equals_bf16p_mirror_of_64_row_blocks(num_splits, ws3_impl):
    """The numeric contract: the reference's blockwise bf16-P mirror with 64-row blocks and v3's split layout,
    with a window that ends inside a block and an entry list that is not a multiple of 64."""
    inputs = _v4_inputs(4, 64, 200, W=100)
    got = run_op(inputs, num_splits=num_splits)
    blocks = -(-100 // 64) + -(-200 // 64)
    if num_splits is None:
        splits = kernels.choose_num_splits(4, 64, 100, 200, block_n=64)[0]
    else:
        splits = kernels.split_layout(blocks, num_splits)[0]
    _assert_mirrors(got.cpu(), _mirror({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                                       64, splits))


@pytest.mark.cuda
def test_cuda_partial_window_inactive_rows_few_entries(ws3_impl):
    partial_window_inactive_rows_few_entries(lambda inputs: _check_vs_v1(inputs, ws3_impl))


@pytest.mark.cuda
def test_cuda_nan_and_out_of_range_flags(ws3_impl):
    nan_and_out_of_range_flags()


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["csa", "hca_split"])
def test_cuda_chunked_kv_same_bits(case, ws3_impl):
    """``KV_CHUNKS = 8`` moves the K/V buffer into per-chunk allocations and splits the MMAs over them with the same
    k16 steps: the same bits as one allocation, through the op (split combine included)."""
    inputs = _v4_inputs(7, 64, 512) if case == "csa" else _v4_inputs(2, 64, 1024, context=1024)
    kw = {} if case == "csa" else {"num_splits": 3}
    one = run_op(inputs, **kw)
    ws3_impl.setitem(ws3.WS3_CONFIG, "KV_CHUNKS", 8)
    chunked = run_op(inputs, **kw)
    assert torch.equal(chunked, one)
    assert_close_to_reference(chunked, run_ref(inputs))


@pytest.mark.cuda
@pytest.mark.parametrize("kv_chunks", [1, 8])
def test_cuda_nan_rows_policy(kv_chunks, ws3_impl):
    """NaN query rows / a NaN selected row (alone in its split too) give NaN, queries without valid rows zeros,
    other rows keep their bits; NaN / -inf sinks (``test_sparse_attention.nan_rows_policy`` / ``nan_sink_policy``);
    both K/V layouts (one epilogue)."""
    ws3_impl.setitem(ws3.WS3_CONFIG, "KV_CHUNKS", kv_chunks)
    nan_rows_policy("cuda", v4=True)
    nan_sink_policy("cuda", v4=True)
