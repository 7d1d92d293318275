"""Argument checks of megamoe.ops.v4_elementwise: layouts the kernels need, empty batches on both paths, and
scalar arguments (eps, rotate, weight_scale) named in the errors."""
import pytest
import torch

from megamoe.ops import v4_elementwise as ew
from megamoe.reference import v4_numerics as nx
from guard_helpers import set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BF16 = torch.bfloat16


def _freqs(rd=64, n=32):
    return nx.rope_frequencies(rd, n, base=10000.0)


def _strided(t):
    """Same values, stride 2 (non-contiguous)."""
    buf = torch.zeros(2 * t.shape[0], dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


def _positions():
    return torch.tensor([0, 5, 31], dtype=torch.int32)


def _qkv(positions, **kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2 * 128, generator=g).to(BF16)
    kv = torch.randn(3, 128, generator=g).to(BF16)
    args = dict(num_heads=2, eps=1e-6)
    args.update(kw)
    return ew.q_kv_path(q, kv, torch.rand(128, generator=g) + 0.5, _freqs(), positions, **args)


def _index_q(positions, **kw):
    g = torch.Generator().manual_seed(1)
    args = dict(n_heads=2, weight_scale=0.25)
    args.update(kw)
    return ew.index_q_path(torch.randn(3, 2 * 64, generator=g).to(BF16), torch.randn(3, 2, generator=g).to(BF16),
                           _freqs(), positions, **args)


def _output(positions, **kw):
    g = torch.Generator().manual_seed(2)
    return ew.output_path(torch.randn(3, 4, 128, generator=g).to(BF16), _freqs(), positions, groups=2, **kw)


def _post_pool(positions, **kw):
    g = torch.Generator().manual_seed(3)
    args = dict(shift=-3, eps=1e-6, rotate=True)
    args.update(kw)
    out = torch.zeros(3, 128, dtype=BF16)
    return ew.post_pool(torch.randn(3, 128, generator=g), torch.rand(128, generator=g) + 0.5, _freqs(),
                        positions + 3, out, **args)


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("op", [_qkv, _index_q, _output, _post_pool])
def test_non_contiguous_positions_give_the_contiguous_result(op, interpret, monkeypatch):
    """positions with a stride: the kernels index them as contiguous, so the Triton path used to read the wrong
    positions (q_kv_path: 225 of 768 elements wrong)."""
    set_interpret(monkeypatch, interpret)
    pos = _positions()
    want = op(pos)
    got = op(_strided(pos))
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)) if g.dtype == BF16 else torch.equal(g, w)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_empty_batch_on_both_paths(interpret, monkeypatch):
    """T = 0 tokens: empty results on both paths (the torch path used to raise 'cannot reshape tensor of 0
    elements')."""
    set_interpret(monkeypatch, interpret)
    pos = torch.zeros(0, dtype=torch.int32)
    o = ew.output_path(torch.zeros(0, 4, 128, dtype=BF16), _freqs(), pos, groups=2)
    assert o.shape == (2, 0, 256) and o.dtype == BF16
    q, kv = ew.q_kv_path(torch.zeros(0, 256, dtype=BF16), torch.zeros(0, 128, dtype=BF16), torch.ones(128), _freqs(),
                         pos, num_heads=2, eps=1e-6)
    assert q.shape == (0, 2, 128) and kv.shape == (0, 128)
    iq, iw = ew.index_q_path(torch.zeros(0, 128, dtype=BF16), torch.zeros(0, 2, dtype=BF16), _freqs(), pos,
                             n_heads=2, weight_scale=0.25)
    assert iq.shape == (0, 2, 64) and iw.shape == (0, 2)


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("eps,exc", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                     ("x", TypeError), (None, TypeError), (True, TypeError),
                                     (torch.tensor(1e-6), TypeError)])
def test_eps_must_be_a_finite_non_negative_float(eps, exc, interpret, monkeypatch):
    set_interpret(monkeypatch, interpret)
    x = torch.randn(3, 64).to(BF16)
    with pytest.raises(exc, match="^eps: expected a finite float >= 0"):
        ew.rms_norm(x, torch.ones(64), eps)
    with pytest.raises(exc, match="^eps: expected a finite float >= 0"):
        _qkv(_positions(), eps=eps)
    with pytest.raises(exc, match="^eps: expected a finite float >= 0"):
        _post_pool(_positions(), eps=eps)


def test_eps_zero_and_ints_are_allowed():
    x = torch.randn(3, 64).to(BF16)
    assert ew.rms_norm(x, None, 0.0).shape == (3, 64)
    assert ew.rms_norm(x, None, 0).shape == (3, 64)


@pytest.mark.parametrize("rotate", ["no", 1, None])
def test_post_pool_rotate_must_be_a_bool(rotate):
    with pytest.raises(TypeError, match="^rotate: expected a bool"):
        _post_pool(_positions(), rotate=rotate)


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("scale", ["x", None, torch.tensor(0.25), float("nan"), True])
def test_index_q_weight_scale_must_be_a_finite_float(scale, interpret, monkeypatch):
    set_interpret(monkeypatch, interpret)
    with pytest.raises((TypeError, ValueError), match="^weight_scale: expected a finite float"):
        _index_q(_positions(), weight_scale=scale)
