"""Fused hyper-connection kernels (hc_pre + RMSNorm, hc_post, hc_head + norm) against the PyTorch formulas.

Exactness statement (``megamoe.kernels.hyper_connection``): the mixes GEMV and the sums of squares are float32 sums
in another order, so

* pre / post / comb are within 2e-6 (absolute; they are O(1)) of the reference;
* ``y = bf16(sum_k pre_k x_k)`` (no norm) is within 1 bf16 ulp of the reference, on <= 1e-3 of the elements
  (measured ~1e-4 at V4-Flash dims), and bit-exact given the kernel's own pre (same float32 operation order, no
  FMA contraction);
* the fused RMSNorm is within 1 bf16 ulp of ``rms_norm`` of the kernel's own bf16 ``y``, on <= 1e-3 of the elements
  (only its sum of squares has another order); against the whole reference chain an output is within 2 ulps (an
  element whose ``y`` flipped moves by one ulp before the norm's rounding), and a flipped ``y`` element shifts the
  norm factor by ~2**-8 / D relative, which flips ~1 % of a small-D row (~1e-4 at D = 4096): <= 2e-2 tested;
* ``hc_post`` is bit-exact.
Fractions allow at least 3 differing elements (the tests' rows are small).
"""
import os
import subprocess
import sys

import pytest
import torch

from megamoe.kernels.hyper_connection import launch_hc_post, launch_hc_post_pre, launch_hc_pre, mix_plan
from megamoe.ops import hyper_connection as hc_ops
from megamoe.reference import v4_numerics as nx
from sync_helpers import no_host_syncs

HC, ITERS, EPS = 4, 20, 1e-6
FLIP_FRACTION = 1e-3
# Posts / combs against the reference's (another float32 summation order of the mix logits, then the sigmoid and
# the Sinkhorn). 2e-6 flaked in CI (part 30): 2.38e-6 = 20 float32 ulps of a post in [1, 2) at T = 17, D = 80; 160
# seeded cases on the CPU (40 seeds x 4 shapes) stayed within 1.2e-6. 4e-6 (~34 ulps) keeps a margin of 250x to a
# wrong Sinkhorn (iterations, eps, a transposed comb), which moves posts / combs by >= 1e-3.
MIX_ATOL = 4e-6
# V4-Flash dims: the mix logits are float32 dots over HC * D = 16384 terms (16x the CPU tests' 512-1024), whose
# sum-order error grows with sqrt(length): 8e-6 (the H100 at T = 512 saw 2.44e-6 on 6 of 2048 posts).
MIX_ATOL_V4 = 8e-6


def _ordinal(t):
    b = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def assert_bf16_close(got, want, fraction=FLIP_FRACTION, max_ulps=1):
    """Equal except <= ``max_ulps`` bf16 ulps on <= ``fraction`` of the elements (at least 3 allowed); NaN where the
    reference is NaN."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ulps = (_ordinal(got[~nan]) - _ordinal(want[~nan])).abs()
    if ulps.numel():
        assert int(ulps.max()) <= max_ulps, f"max {int(ulps.max())} ulps"
        assert int((ulps > 0).sum()) <= max(3, fraction * ulps.numel()), f"{int((ulps > 0).sum())} of {ulps.numel()}"


def assert_mix_close(got, want, x, factor=None):
    """``sum_k pre_k x_k`` (optionally times a per-element ``factor``, e.g. the RMSNorm scale) with ``pre`` from
    float32 mixes summed in another order (~1e-6 relative): within one bf16 rounding (two with the norm's) plus
    1e-5 * sum_k |x_k| * factor. A cancelling sum (|y| << sum |x_k|) may then move many ulps of its own tiny
    value, even change sign (seen on the GPU at T = 64 / 512: 3 ulps, and a +-1e-6 pair 26759 "ulps" apart)."""
    got_f, want_f = got.cpu().float(), want.cpu().float()
    nan = torch.isnan(want_f)
    assert torch.equal(torch.isnan(got_f), nan)
    ulp = torch.exp2(torch.floor(torch.log2(want_f.abs().clamp_min(2.0 ** -126))) - 7)
    mag = x.cpu().float().abs().sum(1)
    if factor is not None:
        mag = mag * factor.cpu().float()
    bound = 2 * ulp + 1e-5 * mag
    err = (got_f - want_f).abs()
    ok = (err <= bound) | nan
    assert bool(ok.all()), f"{int((~ok).sum())} elements, worst {float((err / bound)[~ok].max()):.2f}x the bound"
    assert int((err > 0).sum()) <= max(3, 2e-2 * err.numel())




def assert_norm_mix_close(got, ref_y, x, w):
    """``rms_norm(sum_k pre_k x_k) * w`` against the reference's (``ref_y``: its unnormalised float mix sum, (T, D)):
    :func:`assert_mix_close` with the norm's scale as the factor (a fixed ulp count flaked in CI: 80 ulps on one
    near-zero element, a cancelling sum at T = 17)."""
    ref_y = ref_y.cpu()
    factor = torch.rsqrt(ref_y.float().square().mean(-1, keepdim=True) + EPS) * w.cpu().float().abs()
    assert_mix_close(got, nx.rms_norm(ref_y, w.cpu(), EPS), x, factor)


def make(T, D, device, *, head=False):
    M = HC if head else (2 + HC) * HC
    K = HC * D
    x = torch.randn(T, HC, D, device=device).to(torch.bfloat16)
    fn = torch.randn(M, K, device=device) * K ** -0.5 * 2
    scale = torch.rand(1 if head else 3, device=device) + 0.5
    base = torch.randn(M, device=device)
    w = torch.rand(D, device=device) + 0.5
    return x, fn, scale, base, w


def reference_pre(x, fn, scale, base, w):
    y, post, comb = nx.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    return y, nx.rms_norm(y, w, EPS), post, comb


@pytest.mark.parametrize("T,D", [(0, 128), (1, 128), (3, 256), (17, 128), (5, 200)])
def test_hc_pre_fused_norm_matches_reference(device, T, D):
    x, fn, scale, base, w = make(T, D, device)
    y, post, comb = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    ry, rn, rpost, rcomb = reference_pre(x.cpu(), fn.cpu(), scale.cpu(), base.cpu(), w.cpu())
    assert y.shape == (T, D) and post.shape == (T, HC) and comb.shape == (T, HC, HC)
    torch.testing.assert_close(post.cpu(), rpost, rtol=0, atol=MIX_ATOL)
    torch.testing.assert_close(comb.cpu(), rcomb, rtol=0, atol=MIX_ATOL)
    assert_norm_mix_close(y, ry, x, w)
    plain = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS)[0]
    # pre from mixes summed in another order: a cancelling sum may move 2+ ulps of its small value (seed 21)
    assert_mix_close(plain, ry, x)
    assert_bf16_close(y, nx.rms_norm(plain.cpu(), w.cpu(), EPS))
    if T:  # a wrong rounding point (norm of the float32 y, or no norm) fails against these
        assert not torch.equal(y.cpu(), ry)


@pytest.mark.parametrize("T,D", [(16, 64), (17, 72)])
def test_hc_pre_tensor_core_mixes_match_reference(device, monkeypatch, T, D):
    """The tensor-core steps of the mixes (fn split into three bf16 terms, exact products, one rounded add per step;
    forced in the interpreter, chosen by the GPU from MIX_TC_MIN_T tokens): the same bounds as the float32 FMA steps,
    and the fused hc_post + hc_pre equals the unfused ops bit for bit on that path too. A split that drops the lo term
    moves the mixes by ~2**-16 of |fn| and fails the post / comb bound (tried). The 64-token tiles (T > 64) run in
    the CUDA tests only (the interpreter's finish kernel takes ~1 s per token)."""
    from megamoe.kernels.hyper_connection import mix_tensor_cores

    monkeypatch.setenv("MEGAMOE_HC_MIX_TC", "1")
    x, fn, scale, base, w = make(T, D, device)
    assert mix_tensor_cores(T, fn.is_cuda) and mix_plan(T, D, True)[1]
    assert not torch.equal(fn, fn.bfloat16().float())  # random float32 values: all three bf16 terms are needed
    y, post, comb = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    ry, rn, rpost, rcomb = reference_pre(x.cpu(), fn.cpu(), scale.cpu(), base.cpu(), w.cpu())
    torch.testing.assert_close(post.cpu(), rpost, rtol=0, atol=MIX_ATOL)
    torch.testing.assert_close(comb.cpu(), rcomb, rtol=0, atol=MIX_ATOL)
    assert_norm_mix_close(y, ry, x, w)
    y_in = torch.randn(T, D, device=device).to(torch.bfloat16)
    p_in, c_in = torch.rand(T, HC, device=device) * 2, torch.rand(T, HC, HC, device=device)
    kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    h, xf, pf, cf = hc_ops.hc_post_pre(y_in, x, p_in, c_in, fn, scale, base, **kw)
    h2 = hc_ops.hc_post(y_in, x, p_in, c_in)
    xu, pu, cu = hc_ops.hc_pre(h2, fn, scale, base, hc=HC, **kw)
    assert torch.equal(h, h2) and torch.equal(xf, xu) and torch.equal(pf, pu) and torch.equal(cf, cu)


@pytest.mark.parametrize("T,D", [(1, 256), (17, 128), (4, 200)])
def test_hc_pre_exact_given_kernel_weights(device, T, D):
    """y is the reference's bf16(sum_k pre_k x_k) bit for bit given the kernel's pre; the norm is <= 1 ulp."""
    x, fn, scale, base, w = make(T, D, device)
    y, pre, post, comb = launch_hc_pre(x, fn, scale, base, None, iters=ITERS, hc_eps=EPS, norm_eps=EPS, rms_eps=EPS)
    want = (pre.unsqueeze(-1) * x.float()).sum(-2).to(torch.bfloat16)
    assert torch.equal(y, want)
    yn = launch_hc_pre(x, fn, scale, base, w, iters=ITERS, hc_eps=EPS, norm_eps=EPS, rms_eps=EPS)[0]
    assert_bf16_close(yn, nx.rms_norm(y, w, EPS))
    # comb is doubly stochastic (the last normalisation makes columns sum to 1): a wrong axis fails this
    assert torch.allclose(comb.sum(-2).cpu(), torch.ones(T, HC), atol=1e-4)


@pytest.mark.parametrize("T,D", [(0, 128), (1, 128), (3, 256), (17, 128), (2, 200)])
def test_hc_post_exact(device, T, D):
    y = torch.randn(T, D, device=device).to(torch.bfloat16)
    res = torch.randn(T, HC, D, device=device).to(torch.bfloat16)
    post = torch.rand(T, HC, device=device) * 2
    comb = torch.rand(T, HC, HC, device=device)
    got = hc_ops.hc_post(y, res, post, comb)
    assert got.shape == (T, HC, D) and got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), nx.hc_post(y.cpu(), res.cpu(), post.cpu(), comb.cpu()))
    if T:  # comb transposed (sum over k instead of j) must not pass
        assert not torch.equal(got.cpu(), nx.hc_post(y.cpu(), res.cpu(), post.cpu(), comb.transpose(1, 2).cpu()))


@pytest.mark.parametrize("T,D", [(0, 128), (1, 128), (3, 256), (17, 200)])
def test_hc_head_fused_norm_matches_reference(device, T, D):
    x, fn, scale, base, w = make(T, D, device, head=True)
    got = hc_ops.hc_head(x, fn, scale, base, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    ref = nx.hc_head(x.cpu(), fn.cpu(), scale.cpu(), base.cpu(), hc_eps=EPS, norm_eps=EPS)
    assert got.shape == (T, D)
    assert_norm_mix_close(got, ref, x, w)
    plain = hc_ops.hc_head(x, fn, scale, base, hc_eps=EPS, norm_eps=EPS)
    # y = sum_k pre_k x_k with pre from float32 mixes summed in another order (~1e-6 relative): one bf16 rounding
    # of y plus 1e-5 of sum_k |x_k| (a cancelling sum can then move by 2 ulps of its small result)
    got_f, ref_f = plain.cpu().float(), ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(ref_f.abs().clamp_min(2.0 ** -126))) - 7)
    bound = ulp + 1e-5 * x.cpu().float().abs().sum(1)
    assert ((got_f - ref_f).abs() <= bound).all(), float(((got_f - ref_f).abs() / bound).max())
    assert int((got_f != ref_f).sum()) <= max(3, 1e-2 * ref_f.numel())
    assert_bf16_close(got, nx.rms_norm(plain.cpu(), w.cpu(), EPS))


def test_non_finite_confined_to_token(device):
    T, D = 6, 128
    x, fn, scale, base, w = make(T, D, device)
    clean = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    bad = x.clone()
    bad[1, 2, 5] = float("nan")
    bad[3, 0, 7] = float("inf")
    got = hc_ops.hc_pre(bad, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    ref = reference_pre(bad.cpu(), fn.cpu(), scale.cpu(), base.cpu(), w.cpu())
    ok = [0, 2, 4, 5]
    for g, c, r in zip(got, clean, (ref[1], ref[2], ref[3])):
        assert torch.equal(g[ok].cpu(), c[ok].cpu())  # other tokens untouched, bit for bit
        assert torch.equal(torch.isnan(g.cpu()), torch.isnan(r))  # the bad tokens: NaN as in the reference
    assert torch.isnan(got[0][1]).all() and torch.isnan(got[0][3]).all()
    post_in = hc_ops.hc_post(got[0].nan_to_num(), bad, clean[1], clean[2])
    want = nx.hc_post(got[0].nan_to_num().cpu(), bad.cpu(), clean[1].cpu(), clean[2].cpu())
    assert (torch.equal(post_in.cpu().nan_to_num(), want.nan_to_num())
            and torch.equal(post_in.isnan().cpu(), want.isnan()))
    assert torch.equal((~torch.isfinite(post_in.cpu())).flatten(1).any(-1),
                       torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.bool))  # Inf / NaN stay in tokens 1 and 3


def _post_inputs(T, D, device, head=False):
    x, fn, scale, base, w = make(T, D, device, head=head)
    y = torch.randn(T, D, device=device).to(torch.bfloat16)
    post = torch.rand(T, HC, device=device) * 2
    comb = torch.rand(T, HC, HC, device=device)
    return y, x, post, comb, fn, scale, base, w


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("T,D", [(0, 128), (1, 128), (3, 200), (5, 128), (17, 72), (17, 80)])
def test_hc_post_pre_equals_unfused(device, T, D, head):
    """The fused hc_post + next hc_pre (or hc_head) is bit for bit hc_post, then hc_pre of its output; h is the
    reference's hc_post exactly. T = 3: the broadcast-product partials, T = 5 / 17: tl.dot (ragged token block);
    D = 200 / 72: ragged hidden slices. On the GPU the bit-for-bit part needs D % 16 == 0 (V4: 4096, 7168): the
    two partial kernels load x from differently aligned addresses otherwise, Triton picks other register layouts
    and the sums of squares / tl.dot partials come out in another float32 order (seen at T = 17, D = 72 on the
    H100, results/gpu_check_v18/d_hc_post_pre_gpu.log); there the outputs agree within the mixes' bound."""
    y, res, post, comb, fn, scale, base, w = _post_inputs(T, D, device, head)
    kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w, head=head)
    h, x, post_n, comb_n = hc_ops.hc_post_pre(y, res, post, comb, fn, scale, base, **kw)
    assert h.shape == (T, HC, D) and x.shape == (T, D)
    assert torch.equal(h.cpu(), nx.hc_post(y.cpu(), res.cpu(), post.cpu(), comb.cpu()))
    if head:
        assert post_n is None and comb_n is None
        want = hc_ops.hc_head(h, fn, scale, base, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
        assert torch.equal(x.cpu(), want.cpu())
        assert_norm_mix_close(x, nx.hc_head(h.cpu(), fn.cpu(), scale.cpu(), base.cpu(), hc_eps=EPS, norm_eps=EPS),
                              h, w)
        return
    want = hc_ops.hc_pre(h, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    if device.type == "cuda" and D % 16:
        torch.testing.assert_close(post_n.cpu(), want[1].cpu(), rtol=0, atol=MIX_ATOL)
        torch.testing.assert_close(comb_n.cpu(), want[2].cpu(), rtol=0, atol=MIX_ATOL)
        torch.testing.assert_close(x.cpu().float(), want[0].cpu().float(), rtol=2.0 ** -7, atol=1e-5)  # <= 2 ulps
    else:
        for g, r in zip((x, post_n, comb_n), want):
            assert torch.equal(g.cpu(), r.cpu())
    ry, rn, rpost, rcomb = reference_pre(h.cpu(), fn.cpu(), scale.cpu(), base.cpu(), w.cpu())
    torch.testing.assert_close(post_n.cpu(), rpost, rtol=0, atol=MIX_ATOL)
    torch.testing.assert_close(comb_n.cpu(), rcomb, rtol=0, atol=MIX_ATOL)
    assert_norm_mix_close(x, ry, h, w)


def test_hc_post_pre_validation_errors():
    y, res, post, comb, fn, scale, base, w = _post_inputs(2, 64, "cpu")
    kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    with pytest.raises(ValueError, match="hc_fn"):
        hc_ops.hc_post_pre(y, res, post, comb, fn[:, :-1], scale, base, **kw)
    with pytest.raises(ValueError, match="hc_scale"):
        hc_ops.hc_post_pre(y, res, post, comb, fn[:HC], scale, base[:HC], head=True, **kw)
    with pytest.raises(ValueError, match="y"):
        hc_ops.hc_post_pre(y[:1], res, post, comb, fn, scale, base, **kw)
    with pytest.raises(TypeError, match="residual"):
        hc_ops.hc_post_pre(y, res.float(), post, comb, fn, scale, base, **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        hc_ops.hc_post_pre(y, res, post, comb, fn, scale, base, norm_weight=w[:-1], **kw)


def test_hc_post_pre_non_finite_confined_to_token(device):
    T, D = 6, 128
    y, res, post, comb, fn, scale, base, w = _post_inputs(T, D, device)
    kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    clean = hc_ops.hc_post_pre(y, res, post, comb, fn, scale, base, **kw)
    bad = res.clone()
    bad[1, 2, 5] = float("nan")
    bad[3, 0, 7] = float("inf")
    got = hc_ops.hc_post_pre(y, bad, post, comb, fn, scale, base, **kw)
    ok = [0, 2, 4, 5]
    for g, c in zip(got, clean):
        assert torch.equal(g[ok].cpu(), c[ok].cpu())
    for g in got[1:]:
        assert torch.isnan(g[1].cpu()).all() and torch.isnan(g[3].cpu()).all()


def test_mix_plan_shapes():
    """T = 1 decode: the broadcast product, one 32-position slice per program, 128 programs at V4-Flash."""
    assert mix_plan(1, 4096) == (1, False, 32, 32, 128, 4)  # BT, DOT, BDI, CH, S, warps
    bt, dot, bdi, ch, S, _ = mix_plan(64, 4096)
    assert dot and bt == 16 and ch % bdi == 0 and S * ch >= 4096
    for T in (1, 2, 3, 4, 5, 17, 64, 129, 4096):
        for D in (72, 200, 4096, 7168):
            for tc in (False, True):
                bt, dot, bdi, ch, S, _ = mix_plan(T, D, tc)
                assert ch % bdi == 0 and (S - 1) * ch < D <= S * ch and (dot or bt >= T or bt == 4)
    from megamoe.kernels import hyper_connection as hcm

    # the tensor-core tiles at prefill sizes
    assert mix_plan(4096, 4096, True)[:3] == (hcm.MIX_TC_BT, True, hcm.MIX_TC_BDI) == (64, True, 16)


def test_validation_errors():
    x, fn, scale, base, w = make(2, 64, "cpu")
    kw = dict(hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    with pytest.raises(TypeError, match="x"):
        hc_ops.hc_pre(x.float(), fn, scale, base, **kw)
    with pytest.raises(ValueError, match="hc_fn"):
        hc_ops.hc_pre(x, fn[:, :-1], scale, base, **kw)
    with pytest.raises(TypeError, match="hc_fn"):
        hc_ops.hc_pre(x, fn.double(), scale, base, **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        hc_ops.hc_pre(x, fn, scale, base, norm_weight=w[:-1], **kw)
    with pytest.raises(ValueError, match="device"):
        hc_ops.hc_pre(x, fn, scale, base.to("meta"), **kw)
    with pytest.raises(ValueError, match="copies"):
        hc_ops.hc_pre(x, fn, scale, base, **{**kw, "hc": 2})
    with pytest.raises(ValueError, match="hc_scale"):
        hc_ops.hc_head(x, fn[:HC], scale, base[:HC], hc_eps=EPS, norm_eps=EPS)
    y = torch.zeros(2, 64, dtype=torch.bfloat16)
    post, comb = torch.zeros(2, HC), torch.zeros(2, HC, HC)
    with pytest.raises(ValueError, match="y"):
        hc_ops.hc_post(y[:1], x, post, comb)
    with pytest.raises(TypeError, match="residual"):
        hc_ops.hc_post(y, x.float(), post, comb)
    with pytest.raises(ValueError, match="comb"):
        hc_ops.hc_post(y, x, post, comb[:, :2])


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile, triton
from megamoe.kernels.hyper_connection import compile_sm90
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
for T, head, post, dim in ((1, False, True, 4096), (1, False, False, 4096), (8, False, True, 4096),
                           (64, False, True, 4096), (512, False, False, 4096), (1, True, True, 4096),
                           (1, False, True, 7168), (64, False, True, 7168), (1, True, True, 7168)):
    for name, c in compile_sm90(T=T, head=head, post=post, dim=dim).items():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"]); f.flush()
            u = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        r = {k: int(re.search(rf"{k}:(\d+)", u).group(1)) for k in ("REG", "LOCAL", "STACK")}
        r["bar"] = c.asm["ptx"].count("bar.sync")
        r["fma"] = c.asm["ptx"].count("fma.rn")
        out[f"{T},{head},{post},{dim},{name}"] = r
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_compile_no_spills():
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("cuobjdump not available")
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = json.loads(subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True,
                                    text=True, check=True, timeout=600).stdout)
    for key, r in res.items():
        assert r["LOCAL"] == 0 and r["STACK"] == 0, (key, r)  # no spills
        assert r["REG"] <= 255, (key, r)
        if "finish" in key or "post_kernel" in key or ("partial" in key and key.startswith(("1,", "2,", "4,"))):
            assert r["fma"] == 0, (key, r)  # enable_fp_fusion=False: products rounded as in the reference
        if "finish" in key:  # the Sinkhorn's normalisations stay in warp shuffles, not shared-memory round trips
            assert r["bar"] <= 16, (key, r)


# ------------------------------------------------------------------------------------------------ CUDA (H100)
def _v4(T, head=False):
    torch.manual_seed(1234 + T)
    return make(T, 4096, "cuda", head=head)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 16, 64, 512, 4096])  # from 16 tokens the mixes' tensor-core steps (64-token tiles
def test_cuda_v4_flash_dims_match_reference(T):             # above 64)
    x, fn, scale, base, w = _v4(T)
    y, post, comb = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)
    ry, rn, rpost, rcomb = reference_pre(x, fn, scale, base, w)
    torch.testing.assert_close(post, rpost, rtol=0, atol=MIX_ATOL_V4)
    torch.testing.assert_close(comb, rcomb, rtol=0, atol=MIX_ATOL_V4)
    norm_factor = torch.rsqrt(ry.float().square().mean(-1, keepdim=True) + EPS) * w.float().abs()
    assert_mix_close(y, rn, x, norm_factor)
    yk, pre, _, _ = launch_hc_pre(x, fn, scale, base, None, iters=ITERS, hc_eps=EPS, norm_eps=EPS, rms_eps=EPS)
    seq = pre[:, 0, None] * x[:, 0].float()  # the reference's order, one rounded op at a time
    for k in range(1, HC):
        seq = seq + pre[:, k, None] * x[:, k].float()
    assert torch.equal(yk, seq.to(torch.bfloat16))
    assert_mix_close(yk, ry, x)
    assert_bf16_close(y, nx.rms_norm(yk, w, EPS))
    out = hc_ops.hc_post(y, x, post, comb)
    mixed = comb[:, 0, :, None] * x[:, 0, None, :].float()
    for j in range(1, HC):
        mixed = mixed + comb[:, j, :, None] * x[:, j, None, :].float()
    assert torch.equal(out, (post[..., None] * y.float()[:, None, :] + mixed).to(torch.bfloat16))
    assert_bf16_close(out, nx.hc_post(y, x, post, comb))
    xh, fh, sh, bh, _ = _v4(T, head=True)
    # the head's y is a mix of the hc copies like hc_pre's: a cancelling sum may move many of its own ulps (seen on
    # the H100 at T = 64: 4 ulps after the norm), so the documented mix bound, scaled by the norm, as for hc_pre
    ry_head = nx.hc_head(xh, fh, sh, bh, hc_eps=EPS, norm_eps=EPS)
    head_factor = torch.rsqrt(ry_head.float().square().mean(-1, keepdim=True) + EPS) * w.float().abs()
    assert_mix_close(hc_ops.hc_head(xh, fh, sh, bh, hc_eps=EPS, norm_eps=EPS, norm_weight=w),
                     nx.rms_norm(ry_head, w, EPS), xh, head_factor)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 64])
def test_cuda_graph_replay_equals_eager_sync_free_deterministic(T):
    x, fn, scale, base, w = _v4(T)
    xh, fh, sh, bh, _ = _v4(T, head=True)

    def step():
        y, post, comb = hc_ops.hc_pre(x, fn, scale, base, hc=HC, iters=ITERS, hc_eps=EPS, norm_eps=EPS,
                                      norm_weight=w)
        h = hc_ops.hc_post(y, x, post, comb)
        return y, post, comb, h, hc_ops.hc_head(h, fh, sh, bh, hc_eps=EPS, norm_eps=EPS, norm_weight=w)

    torch.cuda.synchronize()
    with no_host_syncs():
        eager = step()
    again = step()
    for a, b in zip(eager, again):
        assert torch.equal(a, b)  # fixed-order partial sums: deterministic
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = step()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("dim", [4096, 7168])
def test_cuda_hc_post_pre_fused_equals_unfused_graph_sync_free(T, dim):
    """V4-Flash / V4-Pro dims: the fused chain (attn hc_post + ffn hc_pre, then ffn hc_post + head) equals the
    unfused ops bit for bit, eagerly sync-free, and a graph replay equals the eager run."""
    torch.manual_seed(99 + T)
    y, res, post, comb, fn, scale, base, w = _post_inputs(T, dim, "cuda")
    _, _, _, _, fh, sh, bh, _ = _post_inputs(T, dim, "cuda", head=True)
    kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=w)

    def fused():
        h, x, p, c = hc_ops.hc_post_pre(y, res, post, comb, fn, scale, base, **kw)
        h2, xh, _, _ = hc_ops.hc_post_pre(x, h, p, c, fh, sh, bh, **kw, head=True)
        return h, x, p, c, h2, xh

    def unfused():
        h = hc_ops.hc_post(y, res, post, comb)
        x, p, c = hc_ops.hc_pre(h, fn, scale, base, hc=HC, **kw)
        h2 = hc_ops.hc_post(x, h, p, c)
        return h, x, p, c, h2, hc_ops.hc_head(h2, fh, sh, bh, hc_eps=EPS, norm_eps=EPS, norm_weight=w)

    torch.cuda.synchronize()
    with no_host_syncs():
        eager = fused()
    for a, b in zip(eager, unfused()):
        assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fused()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
