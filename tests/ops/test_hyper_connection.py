"""Fused Sinkhorn mixing weights (Triton, interpreter on CPU) against the PyTorch formula."""
import pytest
import torch

from megamoe.ops import hyper_connection as hc_ops
from megamoe.reference import v4_numerics as nx


@pytest.mark.parametrize("tokens", [0, 1, 5, 17, 40])
def test_hc_split_sinkhorn_kernel_matches_reference(device, tokens):
    hc, iters = 4, 20
    mixes = torch.randn(tokens, (2 + hc) * hc, device=device) * 3
    scale = torch.rand(3, device=device) + 0.5
    base = torch.randn((2 + hc) * hc, device=device)
    got = hc_ops.hc_split_sinkhorn(mixes, scale, base, hc=hc, iters=iters, eps=1e-6)
    want = nx.hc_split_sinkhorn(mixes.cpu(), scale.cpu(), base.cpu(), hc, iters, 1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w, rtol=2e-5, atol=2e-6)
    if tokens:  # Sinkhorn: columns of comb sum to ~1 (the last normalisation), a wrong axis fails this
        assert torch.allclose(got[2].sum(-2).cpu(), torch.ones(tokens, hc), atol=1e-4)


def test_hc_split_sinkhorn_rejects_bad_shapes():
    with pytest.raises(ValueError, match="columns"):
        hc_ops.hc_split_sinkhorn(torch.zeros(2, 23), torch.ones(3), torch.zeros(24), hc=4, iters=2, eps=1e-6)
    with pytest.raises(TypeError, match="mixes"):
        hc_ops.hc_split_sinkhorn(torch.zeros(2, 24, dtype=torch.float64), torch.ones(3), torch.zeros(24), hc=4,
                                 iters=2, eps=1e-6)


@pytest.mark.cuda
def test_hc_pre_fused_matches_reference_cuda():
    x = torch.randn(8, 4, 256, device="cuda").to(torch.bfloat16)
    fn = torch.randn(24, 1024, device="cuda") * 1e-2
    scale, base = torch.rand(3, device="cuda"), torch.randn(24, device="cuda")
    got = hc_ops.hc_pre(x, fn, scale, base, hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6)
    want = nx.hc_pre(x, fn, scale, base, hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)
