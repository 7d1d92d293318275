"""The V4 model from a sharded ModelOpt checkpoint directory (synthetic tiny model written by the test helper):
the same logits as from the in-memory tensors; clear errors for a missing or mis-shaped tensor."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "checkpoint"))
from ckpt_helpers import write_sharded_checkpoint  # noqa: E402

from megamoe.checkpoint.sharded import ShardedCheckpoint  # noqa: E402
from megamoe.models.config import V4_TINY_MODEL  # noqa: E402
from megamoe.models.model import V4Model  # noqa: E402
from megamoe.models.v4_weights import random_state_dict  # noqa: E402

PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], dtype=torch.int64)


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model():
    return V4Model(V4_TINY_MODEL, max_batch=1, max_prefill_tokens=16, max_context=32)


def test_sharded_checkpoint_loads_the_same_model(tmp_path, no_interpreter):
    sd = random_state_dict(V4_TINY_MODEL, seed=3)
    index = write_sharded_checkpoint(tmp_path, sd, max_shard_bytes=256 * 1024)
    assert len(set(index["weight_map"].values())) >= 3  # really sharded
    want = _model()
    want.load_weights(sd)
    got = _model()
    got.load_weights(ShardedCheckpoint(tmp_path))
    assert torch.equal(got.prefill(0, PROMPT), want.prefill(0, PROMPT))


@pytest.mark.parametrize("damage", ["missing", "misshaped"])
def test_sharded_checkpoint_errors_name_the_tensor(tmp_path, damage):
    sd = random_state_dict(V4_TINY_MODEL, seed=3)
    name = "layers.1.attn.wq_b.weight"
    if damage == "missing":
        del sd[name]
    else:
        sd[name] = sd[name][:, :-1].contiguous()
    write_sharded_checkpoint(tmp_path, sd, max_shard_bytes=256 * 1024)
    with pytest.raises(ValueError, match="layers.1.attn.wq_b"):
        _model().load_weights(ShardedCheckpoint(tmp_path))


def test_bad_requests_are_refused_before_any_state_changes(no_interpreter):
    from megamoe.kvcache import DecodeBatch

    model = _model()
    model.load_weights(random_state_dict(V4_TINY_MODEL, seed=3))
    with pytest.raises(ValueError, match="max_prefill_tokens"):  # longer than the prefill buffers
        model.prefill(0, torch.zeros(17, dtype=torch.int64))
    small = V4Model(V4_TINY_MODEL, max_batch=1, max_prefill_tokens=40, max_context=32)
    with pytest.raises(ValueError, match="max_context"):  # a prompt longer than the cache
        small.prefill(0, torch.zeros(33, dtype=torch.int64))
    logits = model.prefill(0, PROMPT)
    batch = DecodeBatch.allocate(1, "cpu")
    with pytest.raises(ValueError, match="batch size"):  # more rows than the decode batch (captured bucket)
        model.prepare_decode(batch, [0, 0])
    assert model.positions[0] == PROMPT.shape[0]  # nothing advanced
    assert torch.isfinite(logits).all()
