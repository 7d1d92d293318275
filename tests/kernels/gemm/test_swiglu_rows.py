"""The scaled SwiGLU of float32 GEMM rows (megamoe/kernels/gemm/swiglu_rows.py) against swiglu_reference, through
the interpreter on CPU (the CUDA path runs in tests/ops/test_gemm_dense_bf16.py)."""
import pytest
import torch

from megamoe.kernels.gemm import swiglu_rows
from megamoe.reference.gemm import swiglu_reference


def _check(out, y, gs, limit):
    ref = swiglu_reference(y.float() * gs.float().reshape(1, -1) if gs.dim() else y.float() * gs.float(), limit)
    finite = ref.isfinite()
    assert torch.equal(out.isnan(), ref.isnan())
    # one bf16 rounding of the same float32 formula (the platform's exp may differ in the last float32 bit)
    torch.testing.assert_close(out.float()[finite], ref[finite], rtol=2.0**-8, atol=1e-30)


@pytest.mark.parametrize("m,n", [(3, 2050), (1, 6), (5, 64)])  # ragged last block of 1024 columns; tiny N
@pytest.mark.parametrize("per_row", [False, True])
def test_scaled_swiglu_matches_reference(device, m, n, per_row):
    g = torch.Generator().manual_seed(m * n)
    y = torch.randn(m, n, generator=g) * 40
    gs = (torch.rand(n, 1, generator=g) + 0.5) * 0.1 if per_row else torch.tensor(0.07)
    y[m // 2, 3] = float("nan")  # one NaN gate/up value: its output column only
    limit = 1.5
    big = torch.full((m, n // 2 + 3), 5.0, dtype=torch.bfloat16)
    out = big[:, : n // 2].to(device) if device.type == "cuda" else big[:, : n // 2]
    swiglu_rows.launch_scaled_swiglu(y.to(device), gs.to(device), out, limit, interpreter=device.type != "cuda")
    _check(out.cpu(), y, gs, limit)
    assert out.cpu()[m // 2, 1].isnan() and out.cpu().isnan().sum() == 1
    if device.type != "cuda":
        assert (big[:, n // 2:] == 5).all(), "columns past N/2 must not be written"
    # the clamp matters at this limit, and gate / up are not swapped: both would fail the check
    with pytest.raises(AssertionError):
        _check(out.cpu(), y, gs, None)
    with pytest.raises(AssertionError):
        _check(out.cpu(), y[:, torch.arange(n) ^ 1], gs if gs.dim() == 0 else gs[torch.arange(n) ^ 1], limit)


def test_scaled_swiglu_no_limit_and_empty(device):
    y = torch.randn(4, 32) * 3
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=device)
    swiglu_rows.launch_scaled_swiglu(y.to(device), torch.tensor(1.0, device=device), out, None,
                                     interpreter=device.type != "cuda")
    _check(out.cpu(), y, torch.tensor(1.0), None)
    empty = torch.empty(0, 16, dtype=torch.bfloat16, device=device)
    assert swiglu_rows.launch_scaled_swiglu(torch.empty(0, 32, device=device), torch.tensor(1.0, device=device),
                                            empty, None, interpreter=device.type != "cuda") is empty
