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
