"""V4Model checks the device error word once per eager step (megamoe/ops/errors.py): the layers' own checks are
off meanwhile; a pending flag raises DeviceIndexError at the end of decode / prefill."""
import pytest
import torch

from megamoe.kvcache import DecodeBatch
from megamoe.models.config import V4_TINY_MODEL
from megamoe.models.model import V4Model
from megamoe.models.v4_weights import random_state_dict
from megamoe.ops import errors

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_model_checks_once_per_eager_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = V4_TINY_MODEL
    model = V4Model(cfg, num_layers=2, max_batch=1, max_prefill_tokens=8, max_context=16)
    model.load_weights(random_state_dict(cfg, seed=5, layers=[0, 1]))
    calls = []
    real = errors.check_errors
    monkeypatch.setattr(errors, "check_errors", lambda device=None: (calls.append(device), real(device))[1])
    model.prefill(0, torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64))
    assert len(calls) == 1, calls  # one check per step, not one per layer
    batch = DecodeBatch.allocate(1, "cpu")
    model.prepare_decode(batch, [0])
    errors.error_word("cpu").fill_(errors.flag("combine", "inv_perm"))  # as if a kernel had dropped a pair
    with pytest.raises(errors.DeviceIndexError, match="inv_perm"):
        model.decode(batch, torch.tensor([9], dtype=torch.int64))
    assert len(calls) == 2 and errors._EAGER_CHECKS  # the layers' checks are back on after the step
    prev = errors.set_eager_checks(False)
    try:
        model.prepare_decode(batch, [0])
        errors.error_word("cpu").fill_(errors.flag("combine", "inv_perm"))
        model.decode(batch, torch.tensor([9], dtype=torch.int64))  # checks off: no raise
        assert len(calls) == 2
    finally:
        errors.set_eager_checks(prev)
        errors.clear_errors("cpu")
