"""Fused NVFP4 quantize / dequantize kernels == the PyTorch reference, bit for bit.

On CPU these run the Triton kernels through the interpreter (conftest sets
TRITON_INTERPRET=1), at small shapes with the interpreter's small tiles so that
several tiles per row / column, masking and the per-tensor partial reduction
are all exercised. On a GPU the same tests run the compiled kernels.
The reference is always evaluated on CPU copies.
"""
import sys

import pytest
import torch
import triton
import triton.language as tl

import megamoe.ops.quantize  # noqa: F401
from megamoe.format.e2m1 import e2m1_encode
from megamoe.kernels import quantize as kernels
import megamoe.reference.quantize  # noqa: F401
from megamoe.format.layouts import swizzled_128x4_shape, to_swizzled_128x4
from megamoe.ops._dispatch import use_triton

ops = sys.modules["megamoe.ops.quantize"]
ref = sys.modules["megamoe.reference.quantize"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (shape, note): rows not a multiple of the tile (4 rows in the interpreter, 8 on GPU), K spanning
# several K tiles and a partial last one, extra leading dims, a single row, a single block.
SHAPES = ((1, 16), (3, 80), (7, 160), (2, 3, 48), (13, 272))


def assert_same(got, want):
    """Packed bytes, scale bytes, global-scale bits and shapes identical."""
    assert got.shape == want.shape
    assert torch.equal(got.data.cpu(), want.data.cpu()), "packed E2M1 bytes differ"
    assert torch.equal(got.block_scale.view(torch.uint8).cpu(), want.block_scale.view(torch.uint8).cpu()), \
        "block-scale bytes differ"
    assert tuple(got.global_scale.shape) == tuple(want.global_scale.shape)
    gbits = got.global_scale.detach().cpu().reshape(-1).view(torch.int32)
    wbits = want.global_scale.detach().cpu().reshape(-1).view(torch.int32)
    assert torch.equal(gbits, wbits), "global-scale bits differ"


def assert_same_values(got, want):
    """Same bits; NaN positions must match (NaN sign/payload bits are not compared)."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    got, want = got[~nan], want[~nan]  # NaN sign/payload bits are not part of the format
    assert torch.equal(got.view(ints), want.view(ints))


def check(x, **kwargs):
    assert use_triton(x), "kernel tests must run the Triton path"
    got = ops.quantize(x, **kwargs)
    cpu_kwargs = dict(kwargs)
    if cpu_kwargs.get("global_scale") is not None:
        cpu_kwargs["global_scale"] = cpu_kwargs["global_scale"].cpu()
    want = ref.quantize(x.cpu(), **cpu_kwargs)
    assert_same(got, want)
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_random_per_tensor_and_per_row(device, dtype, shape):
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 50).to(dtype).to(device)
    check(x)
    check(x, per_row=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_given_global_scale_scalar_and_per_row(device, dtype):
    x = (torch.randn(2, 5, 96) * 7).to(dtype).to(device)
    check(x, global_scale=torch.tensor(0.0123, device=device))
    check(x, global_scale=torch.tensor([[[0.004]]], device=device))  # one element, 3-D: 0-d semantics
    check(x, global_scale=torch.rand(2, 5, 1, device=device) * 0.01 + 1e-4)
    got, _ = check(x, global_scale=torch.rand(1, 5, 1, device=device) * 0.01 + 1e-4)  # broadcast rows
    assert tuple(got.global_scale.shape) == (1, 5, 1)


def test_dequantize_matches_reference(device):
    x = (torch.randn(6, 112) * 3).to(device)
    x[1, 16:32] = float("nan")
    for kwargs in ({}, {"per_row": True}, {"global_scale": torch.tensor(1e-3, device=device)}):
        q = ops.quantize(x, **kwargs)
        qc = q.to("cpu")
        for dtype in DTYPES:
            assert_same_values(ops.dequantize(q, dtype), ref.dequantize(qc, dtype))


def test_dequantize_bf16_rounding(device):
    """Products with more bits than bf16 holds (ties included) and tiny normal scales: RNE like torch."""
    # gs with 9 significant bits: e2m1 * scale = 1 gives exact bf16 ties, rounding down (1 + 2**-8)
    # and up (1 + 3 * 2**-8, odd mantissa); other products need rounding too.
    for g in (1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8):
        gs = torch.tensor(g, device=device)
        x = torch.linspace(-6, 6, 64 * 16, device=device).reshape(64, 16) * g
        x[:, 0] = 6 * g  # block scale exactly 1
        q = ops.quantize(x, global_scale=gs)
        assert_same_values(ops.dequantize(q, torch.bfloat16), ref.dequantize(q.to("cpu"), torch.bfloat16))
    tiny = torch.tensor(2.0**-120 * 1.3, device=device)
    q = ops.quantize(torch.randn(4, 32, device=device) * 2.0**-112, global_scale=tiny)
    assert_same_values(ops.dequantize(q, torch.bfloat16), ref.dequantize(q.to("cpu"), torch.bfloat16))


MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_and_gs", [(0.5, 1.0), (1.25, 0.375)])
def test_e2m1_midpoint_ties(device, dtype, scale_and_gs):
    """x / (block_scale * gs) exactly at every rounding midpoint, both signs: ties go to the even code."""
    block_scale, gs = scale_and_gs
    unit = block_scale * gs
    rows = []
    for m in MIDPOINTS:
        # 6 * unit pins the block scale at exactly block_scale (block_amax / (6 gs) = block_scale).
        rows.append([6 * unit, m * unit, -m * unit, m * unit, 0.0, -0.0] + [m * unit] * 10)
    x = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(x.to(dtype).float(), x), "test values must be exact in the input dtype"
    got, want = check(x.to(dtype).to(device), global_scale=torch.tensor(gs, device=device))
    assert torch.all(want.block_scale.float() == block_scale)
    # the reference's own tie policy, decoded: every midpoint goes to the even neighbour
    decoded = ref.dequantize(want, torch.float32)[:, 1] / unit
    assert decoded.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_near_midpoints(device, dtype):
    """Values just off the midpoints, and inside (2.5, 2.75), [3.5, 3.75), (5, 5.25)."""
    unit = 0.5
    intervals = ((2.5, 2.75), (3.5, 3.75), (5.0, 5.25), (0.2, 0.3), (0.7, 0.8), (1.2, 1.3), (1.7, 1.8))
    rows = []
    for lo, hi in intervals:
        v = lo + (hi - lo) * torch.rand(15)
        v[0] = lo
        rows.append(torch.cat([torch.tensor([6.0]), v]) * unit)
    x = torch.stack(rows)
    for m in MIDPOINTS:  # one ulp either side of each midpoint
        mid = torch.tensor(m * unit)
        up, down = torch.nextafter(mid, torch.tensor(10.0)), torch.nextafter(mid, torch.tensor(0.0))
        rows_m = torch.tensor([6 * unit] + [up.item(), down.item()] * 7 + [mid.item()])
        x = torch.cat([x, rows_m[None]])
    check(x.to(dtype).to(device), global_scale=torch.tensor(1.0, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_underflow_subnormal_scales(device, dtype):
    x = torch.randn(6, 128)
    x[0] = 0.0  # a whole zero row
    x[1, :16] = 0.0  # single zero block
    x[1, 16:32] = -0.0  # negative zero block
    x[2, :16] = torch.randn(16) * 1e-5  # E4M3 scale underflows to 0 with gs = 1
    for j in range(1, 8):  # subnormal e4m3 scales j * 2**-9 and just around them
        x[3, 16 * j:16 * j + 16] = torch.randn(16).clamp(-1, 1) * 6 * j * 2.0**-9 * (1 + 0.01 * (j % 3 - 1))
        x[3, 16 * j] = 6 * j * 2.0**-9
    x[4, :16] = 6 * 2.0**-10  # exactly the underflow tie: scale 2**-10 rounds to 0 (even)
    x[4, 16:32] = 6 * 2.0**-10 * (1 + 2.0**-10)  # just above: smallest subnormal
    x[5, ::3] = -0.0
    x = x.to(dtype).to(device)
    check(x, global_scale=torch.tensor(1.0, device=device))
    check(x)
    check(x, per_row=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_tensor(device, dtype):
    x = torch.zeros(5, 64, dtype=dtype, device=device)
    got, _ = check(x)
    assert got.global_scale.item() > 0  # the amax floor keeps the scale normal
    check(x, per_row=True)
    check(-x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_blocks(device, dtype):
    x = torch.randn(5, 96) * 4
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 47] = -float("inf")
    x[3, :] = float("nan")  # a whole non-finite row: its per-row scale comes from the floor
    x[4, 95] = float("inf")
    x = x.to(dtype).to(device)
    for kwargs in ({}, {"per_row": True}, {"global_scale": torch.tensor(0.01, device=device)}):
        got, _ = check(x, **kwargs)
        scale_bytes = got.block_scale.view(torch.uint8).cpu()
        assert scale_bytes[0, 0] == 0x7F and scale_bytes[1, 1] == 0x7F and scale_bytes[2, 2] == 0x7F
        assert torch.all(got.data.cpu()[0, :8] == 0)


def test_large_values_saturate(device):
    """Huge finite values (amax near float32 max, bf16 max) and a tiny given scale clamp to 448 / code 7."""
    x = torch.randn(4, 64).clamp(-1, 1) * 3e38
    check(x.to(device))
    check(x.to(device), per_row=True)
    check(torch.randn(4, 64, device=device), global_scale=torch.tensor(1e-30, device=device))


def test_swizzled_scale_output(device):
    """Scales also written in the 128x4 layout, padding (rows to 128, cols to 4) written as zeros."""
    for shape, kwargs in (((130, 80), {}), ((5, 48), {"per_row": True}),
                          ((3, 64), {"global_scale": torch.tensor(0.01, device=device)})):
        x = torch.randn(shape, device=device) * 3
        rows_p, cols_p = swizzled_128x4_shape(shape[0], shape[1] // 16)
        buf = torch.full((rows_p, cols_p), 0xAB, dtype=torch.uint8, device=device)  # garbage: must be overwritten
        got = ops.quantize(x, swizzled_scale_out=buf, **kwargs)
        cpu_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        want = ref.quantize(x.cpu(), **cpu_kwargs)
        assert_same(got, want)
        assert torch.equal(buf.cpu(), to_swizzled_128x4(want.block_scale.view(torch.uint8)))


@pytest.mark.parametrize("per_row", [False, True])
def test_compute_global_scale(device, per_row):
    x = torch.randn(3, 7, 64) * 5
    x[0, 0, 0] = float("inf")
    x[1, 2, :] = float("nan")
    x = x.to(device)
    got = ops.compute_global_scale(x, per_row=per_row)
    want = ref.compute_global_scale(x.cpu(), per_row=per_row)
    assert got.shape == want.shape
    assert torch.equal(got.cpu().reshape(-1).view(torch.int32), want.reshape(-1).view(torch.int32))


def test_many_partials_reduction(device):
    """Per-tensor dynamic scale with more chunks than partials: grid-strided amax with the max in the last chunk."""
    x = torch.randn(40, 512)  # 20480 elements; interpreter chunks of 256 -> 80 partials
    x[-1, -1] = 1000.0
    check(x.to(device))
    x = torch.randn(40, 512)
    x[0, 0] = -1000.0
    check(x.to(device))


def test_non_contiguous_input(device):
    base = torch.randn(64, 12, device=device)
    x = base.t()  # (12, 64), non-contiguous
    check(x)
    check(x, per_row=True)
    check(torch.randn(4, 2, 32, device=device).transpose(0, 1))


@triton.jit
def _fast_code_kernel(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, kernels._e2m1_magnitude_code_fast(a), mask=offs < n)


def test_fast_e2m1_code_matches_reference_rounding(device):
    """The bit-trick E2M1 magnitude code == the reference's threshold rounding on hard values."""
    mids = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    bits = mids.view(torch.int32)
    near = torch.cat([bits + d for d in range(-3, 4)]).clamp(min=0).view(torch.float32)
    random_bits = torch.randint(0, 0x41000000, (20000,), dtype=torch.int32).view(torch.float32)  # [0, 8) and below
    special = torch.tensor([float("inf"), 3.4e38, 1e-45, 1e-38, 6.000001, 5.999999])
    a = torch.cat([near, random_bits, special, torch.rand(5000) * 7])
    out = torch.empty(a.shape, dtype=torch.int32, device=device)
    _fast_code_kernel[(triton.cdiv(a.numel(), 1024),)](a.to(device), out, a.numel(), BLOCK=1024)
    want = e2m1_encode(a).to(torch.int32)
    assert torch.equal(out.cpu(), want)
