import pytest
import torch

from megamoe import NVFP4Tensor


def _parts(lead, k, gs_shape=()):
    data = torch.zeros(*lead, k // 2, dtype=torch.uint8)
    scale = torch.zeros(*lead, k // 16, dtype=torch.float8_e4m3fn)
    gs = torch.ones(gs_shape, dtype=torch.float32)
    return data, scale, gs


def test_valid_shapes():
    NVFP4Tensor(*_parts((4,), 32), shape=(4, 32))
    NVFP4Tensor(*_parts((3, 8), 64, (3, 1, 1)), shape=(3, 8, 64))
    NVFP4Tensor(*_parts((3, 8), 64, (3, 8, 1)), shape=(3, 8, 64))
    t = NVFP4Tensor(*_parts((0,), 16), shape=(0, 16))
    assert t.nbytes() == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(data=torch.zeros(4, 16, dtype=torch.int8)), "data"),
        (dict(block_scale=torch.zeros(4, 2, dtype=torch.uint8)), "block_scale"),
        (dict(global_scale=torch.ones((), dtype=torch.float64)), "global_scale"),
        (dict(global_scale=torch.ones(4, 2)), "global_scale"),
        (dict(data=torch.zeros(4, 15, dtype=torch.uint8)), "data"),
        (dict(block_scale=torch.zeros(4, 3, dtype=torch.float8_e4m3fn)), "block_scale"),
        (dict(shape=(4, 24)), "shape"),
    ],
)
def test_invalid(kwargs, match):
    data, scale, gs = _parts((4,), 32)
    args = dict(data=data, block_scale=scale, global_scale=gs, shape=(4, 32))
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        NVFP4Tensor(**args)


def test_row_interleave_round_trip_decodes_the_same_and_is_checked():
    """interleave_rows / rows_in_order invert each other, dequantize reads either layout to the same values, the
    layout survives .to(), and shapes that cannot be interleaved are refused (N % 4, K % 128, 1-D, bad values)."""
    from megamoe.reference.quantize import dequantize, quantize

    w = quantize(torch.randn(2, 12, 256))
    w4 = w.interleave_rows(4)
    assert w4.row_interleave == 4 and not torch.equal(w4.data, w.data)
    assert w4.to("cpu").row_interleave == 4
    back = w4.rows_in_order()
    assert back.row_interleave == 1 and torch.equal(back.data, w.data) and torch.equal(
        back.block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))
    assert w.rows_in_order() is w
    assert torch.equal(dequantize(w4, torch.float32), dequantize(w, torch.float32))
    with pytest.raises(ValueError, match="row_interleave"):
        w4.interleave_rows(4)
    for lead, k in (((6,), 256), ((8,), 64)):
        with pytest.raises(ValueError, match="row_interleave"):
            NVFP4Tensor(*_parts(lead, k), shape=lead + (k,), row_interleave=4)
    with pytest.raises(ValueError, match="row_interleave"):
        NVFP4Tensor(*_parts((), 256), shape=(256,), row_interleave=4)
    for bad in (2, 4.0, True):
        with pytest.raises(ValueError, match="row_interleave"):
            NVFP4Tensor(*_parts((8,), 256), shape=(8, 256), row_interleave=bad)
