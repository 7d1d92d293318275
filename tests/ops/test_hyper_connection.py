"""Fused Sinkhorn mixing weights (Triton, interpreter on CPU) against the PyTorch formula."""
import pytest
import torch

from megamoe.ops import hyper_connection as hc_ops
from megamoe.reference import v4_numerics as nx
from guard_helpers import set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)


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


def _hc_inputs(T=3, hc=4, D=16):
    M = (2 + hc) * hc
    return dict(x=torch.randn(T, hc, D).to(torch.bfloat16), hc_fn=torch.randn(M, hc * D) * 1e-2,
                hc_scale=torch.rand(3) + 0.5, hc_base=torch.randn(M))


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("kw,exc,match", [
    (dict(iters=True), ValueError, "iters"), (dict(iters=0), ValueError, "iters"),
    (dict(iters=2.0), ValueError, "iters"),
    (dict(norm_eps=-1.0), ValueError, "norm_eps"), (dict(norm_eps=float("nan")), ValueError, "norm_eps"),
    (dict(norm_eps=None), TypeError, "norm_eps"), (dict(norm_eps="1e-6"), TypeError, "norm_eps"),
    (dict(hc_eps="x"), TypeError, "hc_eps"), (dict(hc_eps=-1e-6), ValueError, "hc_eps"),
    (dict(hc_eps=float("inf")), ValueError, "hc_eps"),
    (dict(rms_eps=-1.0), ValueError, "rms_eps"), (dict(rms_eps=True), TypeError, "rms_eps"),
])
def test_hc_pre_rejects_bad_scalars(kw, exc, match, interpret, monkeypatch):
    set_interpret(monkeypatch, interpret)
    args = dict(hc=4, iters=2, hc_eps=1e-6, norm_eps=1e-6, norm_weight=torch.ones(16))
    args.update(kw)
    with pytest.raises(exc, match=f"^{match}: expected"):
        hc_ops.hc_pre(**_hc_inputs(), **args)


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("kw,exc,match", [
    (dict(iters=True), ValueError, "iters"), (dict(eps="1e-6"), TypeError, "eps"), (dict(eps=None), TypeError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"), (dict(eps=-1.0), ValueError, "eps"),
])
def test_hc_split_sinkhorn_rejects_bad_scalars(kw, exc, match, interpret, monkeypatch):
    set_interpret(monkeypatch, interpret)
    args = dict(hc=4, iters=2, eps=1e-6)
    args.update(kw)
    with pytest.raises(exc, match=f"^{match}: expected"):
        hc_ops.hc_split_sinkhorn(torch.randn(2, 24), torch.ones(3), torch.zeros(24), **args)


@pytest.mark.parametrize("head", ["yes", 1, None])
def test_hc_post_pre_head_must_be_a_bool(head):
    """head='yes' used to fail on hc_fn's shape (the truthy string picked the head's shapes)."""
    T, hc, D = 2, 4, 16
    inp = _hc_inputs(T, hc, D)
    y, res = torch.randn(T, D).to(torch.bfloat16), inp.pop("x")
    post, comb = torch.rand(T, hc), torch.rand(T, hc, hc)
    with pytest.raises(TypeError, match="^head: expected a bool"):
        hc_ops.hc_post_pre(y, res, post, comb, **inp, iters=2, hc_eps=1e-6, norm_eps=1e-6, head=head)


def test_hc_head_rejects_bad_eps():
    T, hc, D = 2, 4, 16
    x = torch.randn(T, hc, D).to(torch.bfloat16)
    with pytest.raises(ValueError, match="^norm_eps: expected"):
        hc_ops.hc_head(x, torch.randn(hc, hc * D), torch.ones(1), torch.zeros(hc), hc_eps=1e-6, norm_eps=-1.0)
