import pytest
import torch

from megamoe.format.layouts import (
    from_swizzled_128x4,
    from_triton_5d,
    swizzled_128x4_offset,
    swizzled_128x4_shape,
    to_swizzled_128x4,
    to_triton_5d,
)


def _random_scales(rows, cols):
    return torch.randint(0, 127, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 7), (256, 448), (7, 128), (384, 12)])
def test_swizzle_round_trip(rows, cols):
    scale = _random_scales(rows, cols)
    sw = to_swizzled_128x4(scale)
    assert tuple(sw.shape) == swizzled_128x4_shape(rows, cols)
    back = from_swizzled_128x4(sw, rows, cols)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))
    five = to_triton_5d(scale)
    assert five.shape[0] == 1 and tuple(five.shape[3:]) == (2, 256)
    assert torch.equal(from_triton_5d(five, rows, cols).view(torch.uint8), scale.view(torch.uint8))


def test_swizzle_offsets_match_documented_formula():
    rows, cols = 200, 9
    scale = _random_scales(rows, cols)
    flat = to_swizzled_128x4(scale).view(torch.uint8).flatten()
    rows_p, cols_p = swizzled_128x4_shape(rows, cols)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    offsets = swizzled_128x4_offset(r, c, cols_p)
    assert torch.equal(flat[offsets], scale.view(torch.uint8))
    # every byte not addressed by a real scale is padding and zero
    mask = torch.ones(rows_p * cols_p, dtype=torch.bool)
    mask[offsets.flatten()] = False
    assert int(flat[mask].count_nonzero()) == 0
    # hand-checked positions: row 33, col 2 of tile (0, 0) -> (33 % 32) * 16 + 1 * 4 + 2 = 22
    assert int(swizzled_128x4_offset(torch.tensor(33), torch.tensor(2), 12)) == 22
    # row 130, col 5 with 12 padded columns -> tile (1, 1) = 1 * 3 + 1 = 4 -> 4 * 512 + 2 * 16 + 0 + 1
    assert int(swizzled_128x4_offset(torch.tensor(130), torch.tensor(5), 12)) == 4 * 512 + 32 + 1


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="scale"):
        to_swizzled_128x4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="swizzled"):
        from_swizzled_128x4(torch.zeros(128, 8, dtype=torch.uint8), 128, 3)
    with pytest.raises(ValueError, match="scale_5d"):
        from_triton_5d(torch.zeros(1, 1, 1, 2, 128, dtype=torch.uint8), 128, 4)


def test_interleave_weight_rows_places_each_step_run():
    """Row r, K step s, byte b of a (E, N, C) matrix lands at (r // 4) * 4 * C + s * 4 * step + (r % 4) * step + b
    of its expert; scales (step 8) the same way; shapes that do not tile are refused."""
    from megamoe.format.layouts import interleave_weight_rows

    for c, step in ((256, 64), (32, 8)):
        data = torch.randint(0, 256, (3, 12, c), dtype=torch.uint8)
        out = interleave_weight_rows(data, 4, step)
        assert out.shape == data.shape and out.dtype == data.dtype
        r, s, b = torch.meshgrid(torch.arange(12), torch.arange(c // step), torch.arange(step), indexing="ij")
        flat = (r // 4) * 4 * c + s * 4 * step + (r % 4) * step + b
        for e in range(3):
            assert torch.equal(out[e].flatten()[flat.flatten()], data[e][r.flatten(), (s * step + b).flatten()])
    with pytest.raises(ValueError, match="packed"):
        interleave_weight_rows(torch.zeros(2, 6, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed"):
        interleave_weight_rows(torch.zeros(2, 8, 96, dtype=torch.uint8))
