"""NVFP4Tensor rejects non-tensor parts with a message naming the part and the given type."""
import numpy as np
import pytest
import torch

from megamoe.format.tensor import NVFP4Tensor


def test_non_tensor_parts():
    data = torch.zeros(2, 8, dtype=torch.uint8)
    scale = torch.zeros(2, 1).to(torch.float8_e4m3fn)
    gs = torch.tensor(1.0)
    with pytest.raises(TypeError, match="data: expected a torch.Tensor, got numpy.ndarray"):
        NVFP4Tensor(np.zeros((2, 8), np.uint8), scale, gs, (2, 16))
    with pytest.raises(TypeError, match="block_scale: expected a torch.Tensor, got list"):
        NVFP4Tensor(data, [[1.0], [1.0]], gs, (2, 16))
    with pytest.raises(TypeError, match="global_scale: expected a torch.Tensor, got float"):
        NVFP4Tensor(data, scale, 1.0, (2, 16))
    with pytest.raises(TypeError, match="shape"):
        NVFP4Tensor(data, scale, gs, 16)
    assert NVFP4Tensor(data, scale, gs, (2, 16)).shape == (2, 16)
