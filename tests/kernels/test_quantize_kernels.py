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
from megamoe.format.tensor import NVFP4Tensor
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


@pytest.mark.parametrize("k", [64, 1536, 2048])
def test_dequantize_unscaled_bf16_is_exact(device, k):
    """``launch_dequantize(unscaled=True)`` (the dense-bf16 GEMM route's weight): every E2M1 code under every E4M3 scale
    byte (subnormal, negative, the largest, NaN) equals the reference's e2m1 * block_scale bit for bit (NaN: 0x7FC0);
    the global scale passed is not read (NaN here), the GPU configs by K (1536: 512-wide tiles) included."""
    rows = 32
    codes = torch.arange(rows * k) % 16
    codes = codes[torch.randperm(rows * k)]
    data = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(rows, k // 2)
    scale = (torch.arange(rows * k // 16) * 37 % 256).to(torch.uint8).reshape(rows, k // 16)
    t = NVFP4Tensor(data, scale.view(torch.float8_e4m3fn), torch.tensor(1.0), (rows, k))
    expect = ref.dequantize(t, torch.bfloat16)
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
    kernels.launch_dequantize(data.to(device), scale.to(device), torch.full((1,), float("nan"), device=device), out,
                              unscaled=True, interpreter=not out.is_cuda)
    got, want = out.cpu().view(torch.int16), expect.view(torch.int16)
    assert torch.equal(got[~expect.isnan()], want[~expect.isnan()])
    assert bool((got[expect.isnan()] == 0x7FC0).all()) and expect.isnan().any()
    with pytest.raises(ValueError, match="out: the unscaled dequantize writes bf16"):
        kernels.launch_dequantize(data, scale, torch.ones(1), torch.empty(rows, k), unscaled=True)


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
def _division_code_kernel(x_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """The kernels' per-element E2M1 magnitude code of x / d (block divisor set-up, then quotient and code)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    d = tl.load(d_ptr + offs, mask=m, other=1.0)
    s, dp, r = kernels._block_divisor(d, INTERPRET)
    sat = tl.full(d.shape, 16777222.0, tl.float32)  # code 7: the block is quantized
    bits = kernels._e2m1_code_bits(x * s, r, -dp, sat, INTERPRET)
    tl.store(out_ptr + offs, bits - kernels.CODE_BITS_0, mask=m)


def _division_codes(x, d, device):
    """Codes from the kernels' helpers: the interpreter twins on CPU, the inline PTX on a GPU."""
    out = torch.empty(x.shape, dtype=torch.int32, device=device)
    _division_code_kernel[(triton.cdiv(x.numel(), 4096),)](
        x.to(device), d.to(device), out, x.numel(), BLOCK=4096, INTERPRET=device.type == "cpu")
    return out.cpu()


def _ulps(v, k):
    """float32 v >= 0 moved by k units in the last place (0 stays 0), elementwise."""
    return (v.view(torch.int32) + k).clamp(min=0).view(torch.float32)


THRESHOLDS = torch.tensor(MIDPOINTS)


def _hard_divisors():
    """float32 divisors: normal with random and extreme mantissas, E4M3 block scales times global scales, subnormal."""
    g = torch.Generator().manual_seed(1234)
    edges = torch.tensor([1.0, 1 + 2.0**-23, 2 - 2.0**-23, 1.5, 1.25, 1.75])
    mant = torch.cat([torch.rand(400, generator=g) + 1, edges])
    exps = torch.randint(-125, 120, mant.shape, generator=g).float()
    normal = mant * torch.exp2(exps)
    e4m3 = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    gs = torch.tensor([1.0, 0.0123, 2.0**-120 * 1.3, 1e-30, 3e30, 1.0 + 2.0**-23])
    products = (e4m3[:, None] * gs[None, :]).reshape(-1)  # rounded like block_scale * global_scale
    subnormal = torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-127 * 1.7, 2.0**-126 * (1 - 2.0**-22), 2.0**-130 * 1.33])
    return torch.cat([normal, products, subnormal]).to(torch.float32)


def test_division_code_near_thresholds(device):
    """Quotients landing on, around (a few ulps) and at the float32 midpoints next to every E2M1 decision
    threshold, for many divisors: the kernels' reciprocal + exact-residue division gives exactly
    e2m1(RN(x / d)) (float32 division correctly rounded, then ties to the even code)."""
    d = _hard_divisors()
    t = torch.cat([THRESHOLDS, torch.tensor([0.125, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0])])
    base = (t[None, :] * d[:, None]).float()  # RN(t * d): the quotient is t or within an ulp of it
    xs = [_ulps(base, k) for k in range(-3, 4)]
    # x = RN(mu * d) for the float32 midpoints mu on either side of t: hardest cases for the correction step
    up, down = _ulps(t, 1), _ulps(t, -1)
    for mid in ((t.double() + up.double()) / 2, (t.double() + down.double()) / 2):
        x_mid = (mid[None, :] * d[:, None].double()).float()
        xs += [x_mid, _ulps(x_mid, 1), _ulps(x_mid, -1)]
    x = torch.cat([v.reshape(-1) for v in xs])
    dd = d[:, None].expand(base.shape).reshape(-1).repeat(len(xs))
    x = torch.cat([x, -x])
    dd = torch.cat([dd, dd])
    ok = torch.isfinite(x)
    x, dd = x[ok].contiguous(), dd[ok].contiguous()
    got = _division_codes(x, dd, device)
    want = e2m1_encode(x / dd).to(torch.int32) & 7  # float32 division on CPU: correctly rounded
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:3]].tolist()} d={dd[bad[:3]].tolist()}"


def test_division_code_random_and_extreme(device):
    """Random x and d over the whole float32 range (subnormals, huge quotients that overflow, zeros)."""
    g = torch.Generator().manual_seed(99)
    n = 200000
    d = torch.randint(1, 0x7E800000, (n,), generator=g, dtype=torch.int32).view(torch.float32)  # d < 2**126
    q = torch.exp2(torch.rand(n, generator=g) * 8 - 4) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = (q * d).float()
    x[:2000] = torch.randint(0, 0x7F800000, (2000,), generator=g, dtype=torch.int32).view(torch.float32)  # any ratio
    x[2000:2100] = 0.0
    x[2100:2200] = -0.0
    ok = torch.isfinite(x)
    x, d = x[ok].contiguous(), d[ok].contiguous()
    want = e2m1_encode(x / d).to(torch.int32) & 7
    assert torch.equal(_division_codes(x, d, device), want)


def test_e4m3_round_matches_torch(device):
    """The block-scale E4M3 rounding (cvt.rn.satfinite on a GPU, its float twin on CPU) == torch's cast."""
    v = torch.cat([
        torch.arange(0, 0x43E80000, 997, dtype=torch.int32).view(torch.float32),  # 0 .. 464
        (torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()[:, None]
         * torch.tensor([1.0, 1 + 2.0**-5, 1 + 2.0**-4, 1 + 2.0**-4 + 2.0**-23, 1 - 2.0**-24])[None, :]).reshape(-1),
        torch.tensor([2.0**-10, 2.0**-10 * (1 + 2.0**-23), 2.0**-11, 448.0, 460.0, 464.0, 1e30, float("inf")]),
    ])
    value, byte = _e4m3_round_values(v, device)
    clamped = v.clamp(max=448.0)
    want = clamped.to(torch.float8_e4m3fn)
    assert torch.equal(byte, want.view(torch.uint8).to(torch.int32))
    assert torch.equal(value, want.float())


@triton.jit
def _e4m3_round_kernel(v_ptr, value_ptr, byte_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    value, byte = kernels._e4m3_round_sat(v, INTERPRET)
    tl.store(value_ptr + offs, value, mask=offs < n)
    tl.store(byte_ptr + offs, byte, mask=offs < n)


def _e4m3_round_values(v, device):
    v = v.contiguous().to(device)
    value = torch.empty_like(v)
    byte = torch.empty(v.shape, dtype=torch.int32, device=device)
    _e4m3_round_kernel[(triton.cdiv(v.numel(), 4096),)](v, value, byte, v.numel(), BLOCK=4096,
                                                        INTERPRET=device.type == "cpu")
    return value.cpu(), byte.cpu()


def _pinned_blocks(gs, scale_bytes, dtype):
    """Blocks whose first element pins the block scale, the others near every threshold times the divisor."""
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    rows = []
    for s in scales.tolist():
        d = torch.tensor(s, dtype=torch.float32) * gs  # the kernel's and the reference's divisor, if s is pinned
        pin = (torch.tensor(6 * s, dtype=torch.float32) * gs).to(dtype).float()
        near = []
        for t in MIDPOINTS:
            v = (torch.tensor(t) * d).to(dtype)
            if dtype == torch.float32:
                near += [_ulps(v.float(), k).item() for k in (-1, 0, 1)]
            else:  # positive 16-bit patterns: one unit up / down is the next value (0 stays 0)
                bits = v.view(torch.int16)
                near += [(bits + k).clamp(min=0).view(dtype).float().item() for k in (-1, 0, 1)]
        vals = torch.tensor(near[:15])
        rows.append(torch.cat([pin.reshape(1), vals]))
        rows.append(torch.cat([-pin.reshape(1), -torch.tensor(near[6:21])]))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [1.0, 0.0123, 1 + 2.0**-23, 2.0**-120 * 1.3, 1e-30, 1e30, 2.0**-135])
def test_threshold_neighbours_many_scales(device, dtype, gs):
    """Elements on and next to every E2M1 threshold for subnormal and normal E4M3 block scales
    (2**-9 .. 448) and tiny / huge / subnormal given global scales, both signs."""
    if dtype == torch.float16 and not (1e-3 < gs < 1e3):
        pytest.skip("float16 cannot hold these magnitudes")
    g = torch.tensor(gs, dtype=torch.float32)
    scale_bytes = list(range(1, 9)) + [0x0F, 0x30, 0x35, 0x38, 0x3C, 0x4B, 0x5D, 0x66, 0x77, 0x7E]
    x = _pinned_blocks(g, scale_bytes, dtype).to(dtype)
    assert torch.isfinite(x.float()).all()
    check(x.to(device), global_scale=g.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_divisors_full_mantissa(device, dtype):
    """Many blocks with random full-mantissa global scales (so d = block_scale * gs has 24 significant
    bits) and per-block magnitudes over a wide range; per-row given scales."""
    torch.manual_seed(7)
    rows, k = 96, 256
    gs = (torch.rand(rows, 1) + 1) * torch.exp2(torch.randint(-60, 40, (rows, 1)).float())
    mags = torch.exp2(torch.randint(-12, 10, (rows, k // 16, 1)).float()) * gs[:, :, None] * 6
    x = (torch.randn(rows, k // 16, 16) * mags).reshape(rows, k).to(dtype)
    check(x.to(device), global_scale=gs.to(device))
    check(x.to(device))
    check(x.to(device), per_row=True)


def test_overflowing_quotients_and_subnormal_inputs(device):
    """Quotients beyond float32 (tiny given scale, huge elements: the code saturates through NaN / Inf)
    and subnormal elements whose block divisor is subnormal too."""
    x = torch.randn(4, 64) * 3e38 / 4
    x[0, :16] = 3.0e38
    x[1, :16] = torch.tensor([2.0**-149 * k for k in range(1, 17)])
    x[2, :16] = -torch.tensor([2.0**-140 * (k + 0.5) for k in range(16)])
    check(x.to(device), global_scale=torch.tensor(2.0**-149, device=device))
    check(x.to(device), global_scale=torch.tensor(1e-45 * 7, device=device))
    sub = torch.tensor([2.0**-133 * k for k in range(1, 17)] * 4).reshape(4, 16)
    check(sub.to(torch.bfloat16).to(device), global_scale=torch.tensor(2.0**-140, device=device))
    check(sub.to(device), per_row=True)


# ---------------------------------------------------------------------------
# The GPU-only inline PTX of the kernels cannot run here; its integer and bf16
# parts are executed by a small PTX emulator (numpy) and compared with the
# interpreter twins / exact references, which catches wrong selectors,
# constants or operand numbering.
# ---------------------------------------------------------------------------

import inspect  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402


def _asm_blocks(fn_name):
    """The asm strings of kernels.<fn_name> in source order."""
    src = inspect.getsource(kernels)
    start = src.index(f"def {fn_name}(")
    end = src.find("\n@triton.jit", start)
    body = src[start:end if end >= 0 else None]
    return [m.group(1) if m.group(1) is not None else m.group(2)
            for m in re.finditer(r'asm="""(.*?)"""|asm="([^"]+)"', body, re.S)]


def _imm(tok):
    tok = tok.strip()
    if tok.startswith("0f"):
        return np.uint32(int(tok[2:], 16))
    return np.uint32(int(tok, 0) & 0xFFFFFFFF)


def _bf16_to_f32(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_rne(f):
    """float64 array -> bf16 bits, round to nearest even with subnormals (exact via float64)."""
    a = np.abs(f)
    sub = (a + 2.0**-81) - 2.0**-81  # bf16 subnormal grid 2**-133
    with np.errstate(over="ignore", invalid="ignore"):
        b = np.where(a < 2.0**-126, sub, a).astype(np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # normal range: RNE to 8 bits (exact inputs have <= 8 bits here)
    b = np.where(np.isnan(f), 0x7FFF, b)
    return (b | np.where(np.signbit(f), 0x8000, 0)).astype(np.uint32)


def _run_ptx(asm, operands):
    """Execute the asm text on numpy uint32 arrays; operands: list indexed like $0.. ($0 = output)."""
    regs = {f"${i}": v for i, v in enumerate(operands)}
    n = next(v.shape for v in operands if v is not None)

    def get(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(n, _imm(tok), dtype=np.uint32)

    for line in asm.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        dst, src = args[0], [get(a) for a in args[1:]] if not args[1].startswith("{") else None
        if op == "mad.lo.u32":
            val = src[0] * src[1] + src[2]
        elif op == "prmt.b32":
            a, b, c = src
            allb = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            val = np.zeros(n, np.uint32)
            for k in range(4):
                sel = (c >> (4 * k)) & 0xF
                byte = np.choose((sel & 7).astype(np.int64), allb)
                byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
                val |= byte << (8 * k)
        elif op == "mov.b32":
            val = src[0]
        elif op == "lop3.b32":
            a, b, c, lut = src
            val = np.zeros(n, np.uint32)
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                val |= ((lut >> idx) & 1) << bit
        elif op == "and.b32":
            val = src[0] & src[1]
        elif op in ("add.u32", "add.s32"):
            val = src[0] + src[1]
        elif op == "sub.s32":
            val = src[0] - src[1]
        elif op == "shl.b32":
            val = src[0] << src[1]
        elif op == "max.s32":
            val = np.maximum(src[0].view(np.int32), src[1].view(np.int32)).view(np.uint32)
        elif op == "max.s16x2":
            def s16(v):
                return v.astype(np.uint16).view(np.int16)

            lo = np.maximum(s16(src[0] & 0xFFFF), s16(src[1] & 0xFFFF))
            hi = np.maximum(s16(src[0] >> 16), s16(src[1] >> 16))
            val = lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)
        elif op == "max.NaN.xorsign.abs.bf16x2":
            val = np.zeros(n, np.uint32)
            for sh in (0, 16):
                ha, hb = (src[0] >> sh) & 0xFFFF, (src[1] >> sh) & 0xFFFF
                fa, fb = np.abs(_bf16_to_f32(ha)), np.abs(_bf16_to_f32(hb))
                m = np.where(np.isnan(fa) | np.isnan(fb), np.float32("nan"), np.maximum(fa, fb))
                h = np.where(np.isnan(m), 0x7FFF, (m.view(np.uint32) >> 16) | ((ha ^ hb) & 0x8000))
                val |= (h.astype(np.uint32) & 0xFFFF) << sh
        elif op == "mul.rn.bf16x2":
            val = np.zeros(n, np.uint32)
            for sh in (0, 16):
                fa = _bf16_to_f32((src[0] >> sh) & 0xFFFF).astype(np.float64)
                p = fa * _bf16_to_f32((src[1] >> sh) & 0xFFFF).astype(np.float64)
                val |= (_f32_to_bf16_rne(p) & 0xFFFF) << sh
        elif op == "cvt.u16.u32":
            val = src[0] & 0xFFFF
        elif op == "cvt.f32.f16":
            val = src[0].astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        else:
            raise NotImplementedError(op)
        regs[dst] = val.astype(np.uint32)
    return regs["$0"]


def test_ptx_pack_codes_matches_twin():
    (asm,) = _asm_blocks("_pack_codes")
    rng = np.random.default_rng(3)
    n = 50000
    cb0 = np.uint32(kernels.CODE_BITS_0.value)
    ce = rng.integers(0, 8, (4, n)).astype(np.uint32) + cb0
    co = rng.integers(0, 8, (4, n)).astype(np.uint32) + cb0
    w = rng.integers(0, 1 << 32, (4, n), dtype=np.uint64).astype(np.uint32)
    smask = np.where(rng.random(n) < 0.8, 0x88888888, 0).astype(np.uint32)
    got = _run_ptx(asm, [None, *ce, *co, *w, smask, smask, smask, smask])
    for i in range(4):  # the twin, pair by pair: byte i of the output word
        signs = ((w[i] >> 12) & 8) | ((w[i] >> 24) & 0x80)
        want = ((ce[i] - cb0) + ((co[i] - cb0) << 4) + (signs & smask)) & 0xFF
        assert np.array_equal((got >> (8 * i)) & 0xFF, want), f"byte {i}"


def _random_16bit_words(rng, n, kind):
    """Words of two bf16 (kind 0) / fp16 (1) values: normal, subnormal, zero, Inf and NaN of both signs."""
    vals = rng.integers(0, 1 << 16, (n, 2)).astype(np.uint32)
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001] + ([0x7F80, 0xFF80, 0x7FC0, 0x7F7F, 0xFF7F] if kind == 0
                       else [0x7C00, 0xFC00, 0x7E00, 0x7BFF, 0xFBFF]), np.uint32)
    pick = rng.random((n, 2)) < 0.1
    vals = np.where(pick, special[rng.integers(0, len(special), (n, 2))], vals)
    return (vals[:, 0] | (vals[:, 1] << 16)).astype(np.uint32)


def _halves_as_f32(w, kind):
    h = np.stack([w & 0xFFFF, w >> 16], axis=-1)
    if kind == 0:
        return _bf16_to_f32(h)
    return h.astype(np.uint16).view(np.float16).astype(np.float32)


@pytest.mark.parametrize("kind", [0, 1])
def test_ptx_finite_absmax_16x2(kind):
    """Per-row dynamic scale, first sweep: max finite |x| of 16-bit pairs through biased int16 maxima."""
    step, final = _asm_blocks("_finite_absmax_16x2")[kind], _asm_blocks("_finite_absmax_16x2_value")[kind]
    rng = np.random.default_rng(10 + kind)
    rows, words = 3000, 24
    w = np.stack([_random_16bit_words(rng, rows, kind) for _ in range(words)])
    w[:, :5] = (0x7F807F80 if kind == 0 else 0x7C007C00)  # rows with only non-finite values
    acc = np.zeros(rows, np.uint32)
    for k in range(words):
        acc = _run_ptx(step, [None, acc, w[k]])
    got = _run_ptx(final, [None, acc]).view(np.float32)
    x = np.abs(_halves_as_f32(w.T, kind)).reshape(rows, -1)
    want = np.where(np.isfinite(x), x, 0).max(axis=1)
    assert np.array_equal(got, want)


def test_ptx_bf16_block_amax_and_scale():
    """Block amax (NaN/Inf-propagating bf16x2 maxima) and the bf16x2 power-of-two scaling."""
    (absmax,) = _asm_blocks("_bf16x2_absmax")
    final = _asm_blocks("_bf16x2_block_amax")[0]
    (scale,) = _asm_blocks("_bf16x2_scale")
    rng = np.random.default_rng(21)
    n = 20000
    w = np.stack([_random_16bit_words(rng, n, 0) for _ in range(8)])
    m = w[0]
    for k in range(1, 8):
        m = _run_ptx(absmax, [None, m, w[k]])
    got = _run_ptx(final, [None, m]).view(np.float32)
    x = np.abs(_halves_as_f32(w.T, 0)).reshape(n, -1)
    want = np.where(np.isnan(x).any(axis=1), np.nan, x.max(axis=1))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    # scaling by 2**k, k in [-126, 127], rounded like the interpreter twin
    k = rng.integers(-126, 128, n)
    s32 = np.exp2(k.astype(np.float64)).astype(np.float32).view(np.uint32)
    s2 = (s32 & 0xFFFF0000) | (s32 >> 16)
    ws = _run_ptx(scale, [None, w[0], s2])
    exact = _halves_as_f32(w[0], 0).astype(np.float64) * np.exp2(k.astype(np.float64))[:, None]
    want_bits = _f32_to_bf16_rne(exact)
    assert np.array_equal(np.stack([ws & 0xFFFF, ws >> 16], axis=-1), want_bits)
