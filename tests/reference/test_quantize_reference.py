"""The reference quantizer against an independent brute-force oracle and the documented policy."""
import pytest
import torch

from megamoe.format.constants import AMAX_FLOOR, E2M1_VALUES
from megamoe.format.e2m1 import unpack_nibbles
from megamoe.reference.quantize import compute_global_scale, dequantize, quantize

_E4M3_BYTES = torch.arange(127, dtype=torch.uint8)  # all finite non-negative e4m3 values
_E4M3_VALUES = _E4M3_BYTES.view(torch.float8_e4m3fn).double()
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.double)


def _nearest_even(value, grid):
    """Index of the nearest grid value, ties to the even index (float64 search)."""
    dist = (value[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    is_best = dist == best
    idx = torch.arange(grid.numel()).expand_as(dist)
    even_tie = is_best & (idx % 2 == 0)
    pick_even = even_tie.any(dim=-1)
    first_best = torch.where(is_best, idx, grid.numel()).min(dim=-1).values
    first_even = torch.where(even_tie, idx, grid.numel()).min(dim=-1).values
    return torch.where(pick_even & (is_best.sum(-1) > 1), first_even, first_best)


def _oracle(x, gs):
    """Brute-force NVFP4 quantization of a 2-D float32 x with per-row or 0-d float32 gs."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 16, 16)
    gs_b = gs.reshape(-1, 1, 1) if gs.dim() else gs
    six_gs = (gs_b * 6.0).float()
    block_scale_f32 = (xb.abs().amax(-1, keepdim=True) / six_gs).float().clamp(max=448.0)
    scale_idx = _nearest_even(block_scale_f32.double(), _E4M3_VALUES)
    scale = _E4M3_VALUES[scale_idx].float()
    denom = (scale * gs_b).float()
    v = (xb / torch.where(scale > 0, denom, torch.ones(()))).float()
    mag = _nearest_even(v.abs().double().clamp(max=6.0), _E2M1)
    codes = mag | (torch.signbit(v).long() << 3)
    codes = torch.where(scale > 0, codes, torch.zeros((), dtype=torch.long))
    return codes.reshape(rows, k).to(torch.uint8), _E4M3_BYTES[scale_idx].reshape(rows, k // 16)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_brute_force_oracle(per_row, dtype):
    x = (torch.randn(6, 64) * torch.logspace(-3, 2, 6)[:, None]).to(dtype)
    x[0, :16] = 0.0  # a zero block
    t = quantize(x, per_row=per_row)
    codes, scale_bytes = _oracle(x.float(), t.global_scale)
    assert torch.equal(unpack_nibbles(t.data), codes)
    assert torch.equal(t.block_scale.view(torch.uint8), scale_bytes)


def test_midpoint_ties_go_to_even_code():
    gs = torch.tensor(1.0)
    # block scale 1.0 (x amax 6): x / (1 * 1) hits every E2M1 midpoint exactly
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.6, 2.7, 3.6, 3.7, 5.1, 5.2, -0.25, -5.0])
    t = quantize(row[None], gs)
    assert t.block_scale.float().item() == 1.0
    assert unpack_nibbles(t.data)[0].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 5, 5, 6, 6, 7, 7, 8, 14]


def test_global_scale_convention():
    x = torch.randn(4, 32)
    x[1, 3] = -7.5
    gs = compute_global_scale(x)
    assert gs.dim() == 0 and gs.item() == pytest.approx(7.5 / 2688, rel=1e-7)
    per_row = compute_global_scale(x, per_row=True)
    assert per_row.shape == (4, 1)
    assert torch.equal(per_row[:, 0], (x.abs().amax(-1) / 2688).float())
    assert compute_global_scale(torch.zeros(2, 16)).item() == pytest.approx(AMAX_FLOOR / 2688)


def test_zero_and_underflow_blocks_give_zero_scale_and_positive_zero_codes():
    x = torch.zeros(1, 48)
    x[0, 16:32] = -1e-9  # underflows: 1e-9 / (6 * gs) << 2**-10
    x[0, 32] = 1000.0
    t = quantize(x)
    assert t.block_scale.view(torch.uint8)[0].tolist()[:2] == [0, 0]
    assert int(t.data[0, :16].count_nonzero()) == 0
    assert torch.equal(dequantize(t, torch.float32)[0, :32], torch.zeros(32))


def test_negative_zero_and_small_negatives_keep_sign():
    x = torch.tensor([[6.0, -0.0, -0.1, 0.1] + [1.0] * 12])
    codes = unpack_nibbles(quantize(x, torch.tensor(1.0)).data)[0]
    assert codes[:4].tolist() == [7, 8, 8, 0]


def test_nan_inf_poison_only_their_block():
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    t = quantize(x)
    finite = x[torch.isfinite(x)]
    assert t.global_scale.item() == pytest.approx(finite.abs().max().item() / 2688, rel=1e-7)
    sb = t.block_scale.view(torch.uint8)
    assert sb[0, 0].item() == 0x7F and sb[1, 2].item() == 0x7F
    y = dequantize(t, torch.float32)
    assert torch.isnan(y[0, :16]).all() and torch.isnan(y[1, 32:48]).all()
    assert torch.isfinite(y[0, 16:]).all() and torch.isfinite(y[1, :32]).all()


def test_round_trip_error_on_gaussian_data():
    x = torch.randn(64, 1024)
    for per_row in (False, True):
        y = dequantize(quantize(x, per_row=per_row), torch.float32)
        rel = ((y - x).norm() / x.norm()).item()
        assert 0.05 < rel < 0.12, rel  # NVFP4 on Gaussian data: about 9-10% relative RMS


def test_dequantize_dtype_and_per_row_broadcast():
    x = torch.randn(3, 5, 32)
    t = quantize(x, per_row=True)
    assert t.global_scale.shape == (3, 5, 1)
    y = dequantize(t, torch.float16)
    assert y.dtype == torch.float16 and y.shape == x.shape


def test_given_scale_saturates_blocks():
    x = torch.full((1, 16), 100.0)
    t = quantize(x, torch.tensor(0.01))  # 100 / (6 * 0.01) = 1666 -> clamps at 448
    assert t.block_scale.float().item() == 448.0
    assert unpack_nibbles(t.data)[0].tolist() == [7] * 16


def test_empty_rows():
    t = quantize(torch.zeros(0, 32))
    assert t.data.shape == (0, 16) and t.block_scale.shape == (0, 2)
    t = quantize(torch.zeros(0, 32), per_row=True)
    assert t.global_scale.shape == (0, 1)


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        (lambda: quantize(torch.randn(2, 24)), ValueError, "multiple of 16"),
        (lambda: quantize(torch.randint(0, 4, (2, 32))), TypeError, "x"),
        (lambda: quantize(torch.randn(2, 32), torch.tensor(1.0, dtype=torch.float64)), TypeError, "global_scale"),
        (lambda: quantize(torch.randn(2, 32), torch.ones(3, 1)), ValueError, "global_scale"),
        (lambda: dequantize(torch.zeros(2, 16)), TypeError, "NVFP4Tensor"),
    ],
)
def test_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()
