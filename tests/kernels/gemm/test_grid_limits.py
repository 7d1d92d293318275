"""Launch grids within CUDA's limits at prefill sizes: the second and third grid axes hold at most 65535 programs.

The row-wise SwiGLU of route "dense-bf16" (a dense gate/up GEMM of 65536+ rows: a long prefill chunk through the
shared expert) and the split-K two-launch reduction put one program per row on a grid axis. On the second axis a
launch of 65536+ rows fails on the GPU (invalid argument), while the Triton interpreter runs it, so the CPU tests
could not see it. Here every launch of the two launchers at 70000 rows is recorded instead of run (interpreter or
GPU), and its grid checked; on a GPU one real launch at 70000 rows is compared with the reference.
"""
from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from gemm_helpers import random_weight
from megamoe.kernels.gemm import nvfp4_splitk as sk
from megamoe.kernels.gemm import swiglu_rows
from megamoe.reference import gemm as reference_gemm

ROWS = 70000  # past 65535
AXIS_LIMITS = (2 ** 31 - 1, 65535, 65535)


@pytest.fixture
def launched_grids(monkeypatch):
    """[(kernel name, grid)] of every launch while the fixture is active; the kernels do not run."""
    grids = []

    def record(self, *args, grid, warmup=False, **kwargs):
        grids.append((getattr(self.fn, "__name__", str(self.fn)), tuple(grid) if not callable(grid) else grid))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    monkeypatch.setattr(JITFunction, "run", record)
    return grids


def _within_limits(grids):
    assert grids, "nothing was launched"
    for name, grid in grids:
        assert all(0 < size <= limit for size, limit in zip(grid, AXIS_LIMITS)), (name, grid)


def test_swiglu_rows_grid_at_70000_rows(launched_grids):
    y = torch.empty(ROWS, 4)
    out = torch.empty(ROWS, 2, dtype=torch.bfloat16)
    swiglu_rows.launch_scaled_swiglu(y, torch.tensor(1.0), out, None, interpreter=True)
    _within_limits(launched_grids)
    assert launched_grids[0][1][0] == ROWS


def test_splitk_two_launch_reduction_grid_at_70000_rows(launched_grids):
    w = random_weight((8, 64), torch.device("cpu"))
    x = torch.empty(ROWS, 64, dtype=torch.bfloat16)
    out = torch.empty(ROWS, 4, dtype=torch.bfloat16)
    sk.launch_nvfp4_splitk(x, w.data, w.block_scale, w.global_scale, out, interpreter=True,
                           config=sk.INTERPRETER_CONFIGS["fma"], splits=1, swiglu=True)
    names = [name for name, _ in launched_grids]
    assert "_splitk_reduce_kernel" in names, names  # the SwiGLU always takes the two-launch reduction
    _within_limits(launched_grids)


@pytest.mark.cuda
def test_cuda_swiglu_rows_at_70000_rows():
    """A real launch at 70000 rows (it failed with the rows on the grid's second axis) against the reference."""
    dev = torch.device("cuda")
    y = torch.randn(ROWS, 64, device=dev)
    out = torch.empty(ROWS, 32, dtype=torch.bfloat16, device=dev)
    swiglu_rows.launch_scaled_swiglu(y, torch.tensor(0.5, device=dev), out, 7.0)
    want = reference_gemm.swiglu_reference(y.cpu() * 0.5, 7.0)
    torch.testing.assert_close(out.cpu().float(), want, rtol=2.0 ** -8, atol=1e-30)  # test_swiglu_rows.py's bound
