"""The Triton MMA-K-order copy (megamoe/kernels/gemm/mma_k_order.py) against ``format.mma_order.to_mma_k_order``:
bit for bit, rows not a multiple of the program's 32, strided rows, both group sizes, M = 0, bad input."""
import os
import subprocess
import sys

import pytest
import torch

from megamoe.format.mma_order import to_mma_k_order
from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order

_CPU_CODE = """
import torch
from megamoe.format.mma_order import to_mma_k_order
from megamoe.kernels.gemm.mma_k_order import launch_to_mma_k_order
g = torch.Generator().manual_seed(0)
for m, k, bk in ((37, 256, 128), (5, 512, 256), (64, 128, 128)):
    x = torch.randn(m, k + 8, generator=g).bfloat16()[:, 8:]  # strided rows
    out = launch_to_mma_k_order(x, block_k=bk, interpreter=True)
    assert torch.equal(out, to_mma_k_order(x, block_k=bk)), (m, k, bk)
    # a wrong permutation (the identity) must fail the same check
    assert not torch.equal(x.contiguous(), to_mma_k_order(x, block_k=bk))
print("ok")
"""


def test_interpreter_equals_reference():
    """On CPU in a fresh process (TRITON_INTERPRET must be set before Triton is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _CPU_CODE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_bad_input():
    with pytest.raises(TypeError, match="x"):
        launch_to_mma_k_order(torch.zeros(4, 128))  # float32
    with pytest.raises(ValueError, match="K=100"):
        launch_to_mma_k_order(torch.zeros(4, 100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block_k"):
        launch_to_mma_k_order(torch.zeros(4, 128, dtype=torch.bfloat16), block_k=64)
    assert launch_to_mma_k_order(torch.zeros(0, 128, dtype=torch.bfloat16), interpreter=True).shape == (0, 128)


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,bk", [(1, 128, 128), (4095, 4096, 128), (333, 2048, 256), (24576, 2048, 128)])
def test_cuda_equals_reference(m, k, bk):
    x = torch.randn(m, k, device="cuda").bfloat16()
    assert torch.equal(launch_to_mma_k_order(x, block_k=bk), to_mma_k_order(x, block_k=bk))
