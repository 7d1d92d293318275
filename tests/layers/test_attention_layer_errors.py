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
