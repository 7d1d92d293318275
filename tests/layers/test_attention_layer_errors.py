"""Nvfp4Attention checks the device error word after an eager forward (megamoe/ops/errors.py), like Nvfp4MoE:
a masked out-of-range page id raises DeviceIndexError naming the op and argument; checks off: no raise."""
import pytest
import torch

from megamoe.kvcache import DecodeBatch
from megamoe.layers.attention import Nvfp4Attention
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.decoder import attention_weights
from megamoe.models.v4_weights import random_state_dict
from megamoe.ops import errors
from guard_helpers import set_interpret  # tests/guard_helpers.py (tests/ is on sys.path)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def layer(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch paths (same drop and flag rules), fast on CPU
    cfg, i = V4_TINY_MODEL, 2  # layer 2: HCA (compress ratio 16: attends to every stored entry)
    sd = random_state_dict(cfg, seed=3, layers=[i], select=lambda n: ".attn." in n)
    att = Nvfp4Attention(cfg, i, max_batch=1, max_prefill_tokens=16, max_slots=2, max_context=24)
    att.load_weights(attention_weights(sd, cfg, i))
    return att


def test_eager_forward_raises_on_masked_page(layer):
    cfg = layer.cfg
    x = torch.randn(17, cfg.hidden_size).to(torch.bfloat16)
    layer.join(0)
    layer.prepare([0], [0], [16])
    layer.forward_prefill(0, x[:16].contiguous())  # clean; stores entry 0
    assert errors.peek_errors("cpu") == 0
    batch = DecodeBatch.allocate(1, "cpu")
    layer.prepare([0], [16], [17])
    batch.set([0], [16], [True])
    layer.cache.block_table[0, 0] = 10 ** 6  # corrupt: entry 0's page id past the pool
    with pytest.raises(errors.DeviceIndexError, match="sparse_attention: argument 'block_table'"):
        layer.forward_decode(batch, x[16:17].contiguous())
    assert errors.peek_errors("cpu") == 0  # read and cleared by the check
    prev = errors.set_eager_checks(False)
    try:
        layer.forward_decode(batch, x[16:17].contiguous())  # checks off: the flag stays in the word
        assert errors.peek_errors("cpu") & errors.flag("sparse_attention", "block_table")
    finally:
        errors.set_eager_checks(prev)
        errors.clear_errors("cpu")


def test_eager_prefill_raises_on_a_pending_flag(layer):
    x = torch.randn(4, layer.cfg.hidden_size).to(torch.bfloat16)
    layer.join(1)
    layer.prepare([1], [0], [4])
    errors.error_word("cpu").fill_(errors.flag("sparse_attention", "slots"))  # as if a kernel had flagged
    with pytest.raises(errors.DeviceIndexError, match="sparse_attention: argument 'slots'"):
        layer.forward_prefill(1, x)


# ------------------------------------------------------------------------------------------------ argument checks
def _layer(i: int, **kw):
    cfg = V4_TINY_MODEL
    sd = random_state_dict(cfg, seed=3, layers=[i], select=lambda n: ".attn." in n)
    args = dict(max_batch=1, max_prefill_tokens=16, max_slots=2, max_context=24)
    args.update(kw)
    att = Nvfp4Attention(cfg, i, **args)
    att.load_weights(attention_weights(sd, cfg, i))
    return att


def _state(att):
    ts = [att.swa_rows]
    if att.cache is not None:
        ts += [att.cache.block_table, att.cache.state.tail_len, att.cache.state.tail_k] + att.cache.pool.tensors()
    return [t.view(torch.uint8).clone() if t.dtype.is_floating_point else t.clone() for t in ts]


@pytest.mark.parametrize("i", [0, 1, 2])  # window-only, CSA, HCA
def test_prefill_slot_validated_for_every_layer_kind(monkeypatch, i):
    """slot -1 used to write slot 1's window rows on a window-only layer, True acted as slot 1, 2 / 100 / 0.0
    raised IndexError: every layer kind now raises the CSA layer's ValueError before any write."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    att = _layer(i)
    x = torch.randn(4, att.cfg.hidden_size).to(torch.bfloat16)
    for s in range(2):
        att.join(s)
        att.prepare([s], [0], [4])
    before = _state(att)
    for slot in (-1, True, False, 2, 100, 0.0, "0", None):
        with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 2\)"):
            att.forward_prefill(slot, x)
        for call in (att.join, att.leave):
            with pytest.raises(ValueError, match=r"slot: expected an int in \[0, 2\)"):
                call(slot)
        assert all(torch.equal(a, b) for a, b in zip(before, _state(att))), slot
    att.forward_prefill(1, x)  # a valid slot still works


@pytest.mark.parametrize("i", [0, 2])
def test_forward_rejects_bad_x_and_batch(monkeypatch, i):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    att = _layer(i)
    H = att.cfg.hidden_size
    x = torch.randn(4, H).to(torch.bfloat16)
    att.join(0)
    att.prepare([0], [0], [4])
    before = _state(att)
    for bad, exc, match in ((x.tolist(), TypeError, "^x: expected a torch.Tensor"),
                            (None, TypeError, "^x: expected a torch.Tensor"),
                            (x.float(), TypeError, "^x: expected dtype torch.bfloat16"),
                            (x[:, :-1].contiguous(), ValueError, r"^x: expected shape \(T, 128\)"),
                            (x[0], ValueError, r"^x: expected shape \(T, 128\)")):
        with pytest.raises(exc, match=match):
            att.forward_prefill(0, bad)
        assert all(torch.equal(a, b) for a, b in zip(before, _state(att)))
    batch = DecodeBatch.allocate(1, "cpu")
    batch.set([0], [4], [True])
    att.prepare([0], [4], [5])
    before = _state(att)
    with pytest.raises(TypeError, match="^batch: expected a DecodeBatch"):
        att.forward_decode(None, x[:1])
    for bad, exc, match in ((x[:1].tolist(), TypeError, "^x: expected a torch.Tensor"),
                            (x[:1].float(), TypeError, "^x: expected dtype torch.bfloat16"),
                            (x[:2], ValueError, r"^x: expected shape \(1, 128\)")):
        with pytest.raises(exc, match=match):
            att.forward_decode(batch, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(att)))


@pytest.mark.parametrize("name,value,exc", [
    ("layer", True, ValueError), ("layer", 4, ValueError), ("layer", 1.0, ValueError),
    ("max_batch", True, ValueError), ("max_slots", True, ValueError), ("max_prefill_tokens", False, ValueError),
    ("max_context", True, ValueError), ("entries_per_block", True, ValueError),
    ("entries_per_block", 0, ValueError), ("entries_per_block", 2.0, ValueError),
    ("device", "nonsense", ValueError), ("device", None, TypeError),
])
def test_constructor_rejects_bools_and_bad_devices(name, value, exc):
    args = dict(layer=2, max_batch=1, max_prefill_tokens=16, max_slots=2, max_context=24)
    args[name] = value
    layer = args.pop("layer")
    with pytest.raises(exc, match=f"^{name}: "):
        Nvfp4Attention(V4_TINY_MODEL, layer, **args)


@pytest.mark.parametrize("interpret", ["1", "0"])
@pytest.mark.parametrize("i", [0, 1, 2])
def test_empty_prefill_returns_empty(monkeypatch, interpret, i):
    """T = 0 prompt tokens: a (0, dim) result and no state change on both paths (the output projection used to
    raise 'cannot reshape tensor of 0 elements')."""
    set_interpret(monkeypatch, interpret)
    att = _layer(i)
    att.join(0)
    before = _state(att)
    out = att.forward_prefill(0, torch.zeros(0, att.cfg.hidden_size, dtype=torch.bfloat16))
    assert out.shape == (0, att.cfg.hidden_size) and out.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(before, _state(att)))
