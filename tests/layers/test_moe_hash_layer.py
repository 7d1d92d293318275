"""Hash-routed Nvfp4MoE layers (DeepSeek-V4's first num_hash_layers) and the chunked random weights."""
import pytest
import torch

from megamoe.layers import Nvfp4MoE
from megamoe.layers import moe as layer_module
from megamoe.models import MoEConfig
from sync_helpers import no_host_syncs

TINY = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, shared_intermediate_size=32,
                 scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0, name="tiny")
VOCAB = 50


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def _random(config=TINY, **kwargs):
    """Build with the (bit-exact) reference quantizer: the interpreter's takes seconds per layer on CPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return Nvfp4MoE.random(config, **kwargs)


@pytest.fixture
def no_interpreter(monkeypatch):
    """For tests of the layer's logic (validation, plumbing): CPU references instead of interpreted kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def hash_layer():
    return _random(seed=5, max_num_tokens=16, hash_vocab=VOCAB)


@pytest.mark.parametrize("tokens", [1, 3, 11])  # fused shared expert (<= 16 tokens) ...
def test_hash_layer_matches_reference(hash_layer, tokens):
    x = torch.randn(tokens, TINY.hidden_size).bfloat16()
    ids = torch.randint(0, VOCAB, (tokens,))
    out = hash_layer.forward(x, ids).clone()
    w, e = hash_layer.last_routing
    assert torch.equal(e, hash_layer.tid2eid[ids])
    assert _rel(out, hash_layer.reference_forward(x, token_ids=ids)) < 1e-2
    # the routing really comes from the table: other token ids -> other experts -> another output (each token
    # gets the next id whose table row is another expert set; a random table repeats a set for ~1 in 28 pairs)
    table = hash_layer.tid2eid.cpu()
    rows = [frozenset(r) for r in table.tolist()]
    other = torch.tensor([next(j % VOCAB for j in range(int(t) + 1, int(t) + VOCAB) if rows[j % VOCAB] != rows[int(t)])
                          for t in ids])
    assert _rel(out, hash_layer.reference_forward(x, token_ids=other)) > 5e-2


def test_separate_shared_path_and_torch_router():
    lay = _random(TINY, seed=6, max_num_tokens=32, hash_vocab=VOCAB, fuse_shared_max_tokens=2,
                          router_backend="torch")
    x = torch.randn(20, TINY.hidden_size).bfloat16()
    ids = torch.randint(0, VOCAB, (20,), dtype=torch.int32)
    out = lay.forward(x, ids).clone()
    assert _rel(out, lay.reference_forward(x, token_ids=ids)) < 1e-2


def test_invalid_token_id_gives_nan_row_only(hash_layer):
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    ids = torch.randint(0, VOCAB, (4,))
    clean = hash_layer.forward(x, ids).clone()
    ids[2] = VOCAB + 7
    from megamoe.ops import errors
    with pytest.raises(errors.DeviceIndexError, match="route: argument 'token_ids'"):  # issue 12: flagged
        hash_layer.forward(x, ids)
    prev = errors.set_eager_checks(False)
    try:
        out = hash_layer.forward(x, ids).clone()
    finally:
        errors.set_eager_checks(prev)
        errors.clear_errors("cpu")
    assert torch.isnan(out[2]).all() and torch.equal(out[[0, 1, 3]], clean[[0, 1, 3]])


def test_token_ids_required_and_checked(hash_layer, no_interpreter):
    x = torch.randn(3, TINY.hidden_size).bfloat16()
    with pytest.raises(ValueError, match="token_ids"):
        hash_layer.forward(x)
    with pytest.raises(ValueError, match="token_ids"):
        hash_layer.forward(x, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="token_ids"):
        hash_layer.forward(x, torch.zeros(3))
    with pytest.raises(ValueError, match="token_ids"):
        hash_layer.route(x)
    # a score-routed layer accepts and ignores token ids (uniform model loops)
    plain = _random(seed=5, max_num_tokens=4)
    a = plain.forward(x).clone()
    assert torch.equal(plain.forward(x, torch.tensor([1, 2, 3])), a)


def test_load_weights_validates_the_table(no_interpreter):
    lay, w = Nvfp4MoE.random(TINY, seed=8, max_num_tokens=4, return_bf16=True)
    q = layer_module.quantize_weight
    args = (w["gate_weight"], None, q(w["w13"]), q(w["w2"]), q(w["shared_w13"]), q(w["shared_w2"]))
    good = torch.randint(0, TINY.num_experts, (VOCAB, TINY.top_k))
    lay.load_weights(*args, tid2eid=good)  # int64 accepted, stored as int32
    assert lay.hash_routed and lay.tid2eid.dtype == torch.int32 and torch.equal(lay.tid2eid.long(), good)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        lay.load_weights(*args, tid2eid=good + TINY.num_experts)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        lay.load_weights(*args, tid2eid=good - 1 - 2 ** 33)  # would wrap to a valid int32 if cast first
    with pytest.raises(ValueError, match="tid2eid"):
        lay.load_weights(*args, tid2eid=good[:, :1])
    with pytest.raises(TypeError, match="tid2eid"):
        lay.load_weights(*args, tid2eid=good.float())
    with pytest.raises(ValueError, match="correction_bias"):
        lay.load_weights(w["gate_weight"], torch.zeros(TINY.num_experts), *args[2:], tid2eid=good)


def test_compiled_forward_and_calibrate_take_token_ids(hash_layer):
    x = torch.randn(3, TINY.hidden_size).bfloat16()
    ids = torch.randint(0, VOCAB, (3,))
    expected = hash_layer.forward(x, ids).clone()
    compiled = torch.compile(lambda t, i: hash_layer.compiled_forward(t, i) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, ids), expected * 2, rtol=0, atol=0)
    lay = _random(seed=9, max_num_tokens=8, hash_vocab=VOCAB)
    scales = lay.calibrate(x, ids)
    assert scales["l2"].shape == (TINY.num_experts,)
    assert _rel(lay.forward(x, ids), lay.reference_forward(x, token_ids=ids)) < 5e-2


def test_random_is_chunked_and_chunking_does_not_change_weights(monkeypatch, no_interpreter):
    big = Nvfp4MoE.random(TINY, seed=11, max_num_tokens=4)
    monkeypatch.setattr(layer_module, "RANDOM_CHUNK_ELEMENTS", 3 * 2 * 32 * 64)  # 3 experts per chunk of w13
    calls = []
    real = layer_module.quantize_weight
    monkeypatch.setattr(layer_module, "quantize_weight", lambda w: calls.append(tuple(w.shape)) or real(w))
    small = Nvfp4MoE.random(TINY, seed=11, max_num_tokens=4)
    assert (3, 64, 64) in calls and (2, 64, 64) in calls  # 8 experts: chunks of 3, 3, 2
    assert max(s[0] for s in calls if len(s) == 3) <= 6
    for name in ("w13", "w2"):
        a, b = getattr(big, name), getattr(small, name)
        assert torch.equal(a.data, b.data) and torch.equal(a.global_scale, b.global_scale)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    other = Nvfp4MoE.random(TINY, seed=12, max_num_tokens=4)
    assert not torch.equal(other.w13.data, big.w13.data)
    # return_bf16 gives the weights that were quantized
    lay, w = Nvfp4MoE.random(TINY, seed=11, max_num_tokens=4, return_bf16=True)
    assert torch.equal(lay.w13.data, layer_module.quantize_weight(w["w13"]).data)
    assert not torch.equal(w["w13"][0], w["w13"][1])  # every expert has its own draw


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_cuda_hash_layer_graph_and_no_host_syncs(tokens):
    from megamoe.models.config import DEEPSEEK_V4_FLASH

    lay = Nvfp4MoE.random(DEEPSEEK_V4_FLASH, seed=3, max_num_tokens=64, device="cuda", hash_vocab=129280)
    x = torch.randn(tokens, DEEPSEEK_V4_FLASH.hidden_size, device="cuda").bfloat16()
    ids = torch.randint(0, 129280, (tokens,), device="cuda")
    eager = lay.forward(x, ids).clone()
    assert torch.equal(lay.last_routing[1], lay.tid2eid[ids])
    assert _rel(eager, lay.reference_forward(x, lay.last_routing)) < 1e-2
    torch.cuda.synchronize()
    with no_host_syncs():
        lay.forward(x, ids)
    replay = lay.capture(tokens)
    assert torch.equal(replay(x, ids), eager)
    ids2 = torch.randint(0, 129280, (tokens,), device="cuda")
    eager2 = lay.forward(x, ids2).clone()
    assert torch.equal(replay(x, ids2), eager2)
    with pytest.raises(ValueError, match="token_ids"):
        replay(x)


@pytest.mark.cuda
def test_cuda_v4_pro_random_fits():
    from megamoe.models.config import DEEPSEEK_V4_PRO

    torch.cuda.reset_peak_memory_stats()
    lay = Nvfp4MoE.random(DEEPSEEK_V4_PRO, seed=0, max_num_tokens=8, device="cuda")
    peak = torch.cuda.max_memory_allocated()
    assert peak < 60 * 2 ** 30, peak / 2 ** 30
    x = torch.randn(4, DEEPSEEK_V4_PRO.hidden_size, device="cuda").bfloat16()
    out = lay.forward(x).clone()
    assert _rel(out, lay.reference_forward(x, lay.last_routing)) < 1e-2


def test_set_input_scales_rejects_non_positive_and_nan(no_interpreter):
    lay = _random(seed=2, max_num_tokens=4)
    e = TINY.num_experts
    good = (torch.tensor(0.01), torch.full((e,), 0.02), torch.tensor(0.01), torch.tensor(0.03))
    lay.set_input_scales(*good)
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l1"):
            lay.set_input_scales(torch.tensor(bad), *good[1:])
        l2 = good[1].clone()
        l2[3] = bad
        with pytest.raises(ValueError, match="l2"):
            lay.set_input_scales(good[0], l2, *good[2:])
        with pytest.raises(ValueError, match="shared_l2"):
            lay.set_input_scales(*good[:3], torch.tensor(bad))
    with pytest.raises(TypeError, match="l1"):
        lay.set_input_scales(0.01, good[1], *good[2:])
    with pytest.raises(ValueError, match="shared_l1"):
        lay.set_input_scales(good[0], good[1], torch.ones(2), good[3])
