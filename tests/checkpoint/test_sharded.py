"""Sharded safetensors reading (megamoe/checkpoint/sharded.py): round trip, laziness, every error path, the
tensor checks, and the MoE loader on a sharded directory (including a hash-routed layer)."""
import json
import os

import pytest
import torch
from ckpt_helpers import nvfp4_parts, write_sharded_checkpoint

from megamoe.checkpoint import (
    CheckpointError, ShardedCheckpoint, bf16_moe_state_dict, check_tensor, load_moe_layer, quantize_model_weights,
)
from megamoe.layers import Nvfp4MoE
from megamoe.models import MoEConfig

CFG = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2, shared_intermediate_size=32,
                name="ckpt-tiny")


def _mixed_tensors():
    return {
        "embed.weight": torch.randn(10, 16).bfloat16(),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 4, (10, 2), dtype=torch.int32),
        "layers.0.ffn.gate.weight": torch.randn(4, 16).bfloat16(),
        "layers.1.ffn.gate.bias": torch.randn(4),
        "layers.1.ffn.experts.0.w1.weight": torch.randint(0, 256, (32, 8), dtype=torch.uint8),
        "layers.1.ffn.experts.0.w1.weight_scale": torch.rand(32, 1).to(torch.float8_e4m3fn),
        "layers.1.ffn.experts.0.w1.weight_scale_2": torch.tensor(0.5),
        "head.weight": torch.randn(10, 16).bfloat16(),
    }


def test_roundtrip_lazy_and_prefix(tmp_path):
    tensors = _mixed_tensors()
    index = write_sharded_checkpoint(tmp_path, tensors, max_shard_bytes=400)
    assert len(set(index["weight_map"].values())) >= 3
    with ShardedCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == sorted(tensors) and len(ckpt) == len(tensors) and "head.weight" in ckpt
        assert not ckpt._handles  # nothing opened yet
        t = ckpt.get("layers.1.ffn.gate.bias")
        assert torch.equal(t, tensors["layers.1.ffn.gate.bias"]) and len(ckpt._handles) == 1
        for name, ref in tensors.items():
            got = ckpt[name]
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))
        many = ckpt.get_many("layers.1.")
        assert sorted(many) == sorted(n for n in tensors if n.startswith("layers.1."))
        assert ckpt.info("layers.0.ffn.gate.tid2eid") == ((10, 2), "I32")
        assert ckpt.get("no.such.tensor", None) is None
        assert ckpt.shard_of("head.weight") == index["weight_map"]["head.weight"]


def test_single_file_and_single_shard_directory(tmp_path):
    from safetensors.torch import save_file

    tensors = _mixed_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for source in (tmp_path, tmp_path / "model.safetensors"):
        ckpt = ShardedCheckpoint(source)
        assert ckpt.names() == sorted(tensors) and torch.equal(ckpt["embed.weight"], tensors["embed.weight"])


def test_errors(tmp_path):
    tensors = _mixed_tensors()
    index = write_sharded_checkpoint(tmp_path / "ok", tensors, max_shard_bytes=400)
    with pytest.raises(CheckpointError, match="no such file"):
        ShardedCheckpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        ShardedCheckpoint(tmp_path / "empty")
    ckpt = ShardedCheckpoint(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="missing tensor 'nope'"):
        ckpt.get("nope")
    with pytest.raises(CheckpointError, match="nope"):
        ckpt["nope"]
    assert isinstance(CheckpointError("x"), ValueError)

    def variant(name, edit):
        d = tmp_path / name
        write_sharded_checkpoint(d, tensors, max_shard_bytes=400)
        edit(d)
        return d

    shard = index["weight_map"]["head.weight"]
    d = variant("missing_shard", lambda d: os.remove(d / shard))
    with pytest.raises(CheckpointError, match=shard):
        ShardedCheckpoint(d)

    def bad_json(d):
        (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        ShardedCheckpoint(variant("bad_json", bad_json))

    def no_map(d):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        ShardedCheckpoint(variant("no_map", no_map))

    def escape(d):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match="file name in the checkpoint directory"):
        ShardedCheckpoint(variant("escape", escape))

    def wrong_shard(d):  # the index claims head.weight lives in the first shard
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"]["head.weight"] = idx["weight_map"]["embed.weight"]
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="does not contain"):
        ShardedCheckpoint(variant("wrong_shard", wrong_shard)).get("head.weight")

    def truncate(d):
        path = d / shard
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 7])
    with pytest.raises(CheckpointError, match="corrupt|cannot read"):
        ShardedCheckpoint(variant("truncated", truncate)).get("head.weight")

    def garbage(d):
        (d / shard).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        ShardedCheckpoint(variant("garbage", garbage)).get("head.weight")


def test_check_tensor_kinds():
    assert check_tensor("a", torch.zeros(2, 3).bfloat16(), (2, 3), "bf16").shape == (2, 3)
    check_tensor("b", torch.zeros(4), (4,), "fp32")
    check_tensor("c", torch.zeros(5, 2, dtype=torch.int32), (5, 2), "int32")
    with pytest.raises(CheckpointError, match="'a'.*dtype"):
        check_tensor("a", torch.zeros(2, 3), (2, 3), "bf16")
    with pytest.raises(CheckpointError, match="'a'.*shape"):
        check_tensor("a", torch.zeros(2, 4).bfloat16(), (2, 3), "bf16")
    with pytest.raises(CheckpointError, match="not a tensor"):
        check_tensor("a", [1, 2], (2,), "int32")
    with pytest.raises(ValueError, match="dtype_kind"):
        check_tensor("a", torch.zeros(2), (2,), "fp8")

    good = nvfp4_parts(32, 64)
    p = check_tensor("w", good, (32, 64), "nvfp4")
    assert p["weight_scale"].dtype == torch.float8_e4m3fn and p["weight_scale_2"].dim() == 0
    as_bytes = {**good, "weight_scale": good["weight_scale"].view(torch.uint8)}
    assert check_tensor("w", as_bytes, (32, 64), "nvfp4")["weight_scale"].dtype == torch.float8_e4m3fn
    assert check_tensor("w", nvfp4_parts(32, 64, input_scale=None), (32, 64), "nvfp4")["input_scale"] is None
    cases = [
        ({k: v for k, v in good.items() if k != "weight_scale"}, "missing tensor 'w.weight_scale'"),
        ({**good, "weight": good["weight"][:, :-1]}, "'w.weight' has shape"),
        ({**good, "weight": good["weight"].to(torch.int8)}, "'w.weight' has dtype"),
        ({**good, "weight_scale": good["weight_scale"][:, :2]}, "'w.weight_scale' has shape"),
        ({**good, "weight_scale": good["weight_scale"].float()}, "'w.weight_scale' has dtype"),
        ({**good, "weight_scale_2": torch.tensor([0.1, 0.2])}, "weight_scale_2' must be one float32"),
        ({**good, "weight_scale_2": torch.tensor(-0.1)}, "weight_scale_2' = -0.1"),
        ({**good, "weight_scale_2": torch.tensor(0.0)}, "weight_scale_2' = 0.0"),
        ({**good, "weight_scale_2": torch.tensor(float("nan"))}, "weight_scale_2' = nan"),
        ({**good, "input_scale": torch.tensor(float("inf"))}, "input_scale' = inf"),
        ({**good, "input_scale": torch.tensor(0.0)}, "input_scale' = 0.0"),
    ]
    for parts, message in cases:
        with pytest.raises(CheckpointError, match=message):
            check_tensor("w", parts, (32, 64), "nvfp4")


@pytest.fixture(scope="module")
def layer_state():
    with pytest.MonkeyPatch.context() as mp:  # the reference quantizer (bit-exact, no interpreter): fast
        mp.setenv("TRITON_INTERPRET", "0")
        _, w = Nvfp4MoE.random(CFG, seed=5, max_num_tokens=4, return_bf16=True)
        return quantize_model_weights(bf16_moe_state_dict(w, CFG, "model.layers.3.mlp."),
                                      input_scales=None)


def test_moe_loader_reads_a_sharded_directory(tmp_path, layer_state, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    other = {"model.layers.0.mlp.gate.weight": torch.randn(4, 64).bfloat16()}
    write_sharded_checkpoint(tmp_path, {**other, **layer_state}, max_shard_bytes=4096)
    from_dir = load_moe_layer(tmp_path, CFG, prefix="model.layers.3.mlp.", max_num_tokens=4)
    from_dict = load_moe_layer(layer_state, CFG, prefix="model.layers.3.mlp.", max_num_tokens=4)
    assert torch.equal(from_dir.w13.data, from_dict.w13.data) and torch.equal(from_dir.w2.data, from_dict.w2.data)
    x = torch.randn(3, CFG.hidden_size).bfloat16()
    assert torch.equal(from_dir.forward(x), from_dict.forward(x))


def test_moe_loader_hash_layer_and_scale_errors(layer_state, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = "model.layers.3.mlp."
    hashed = {k: v for k, v in layer_state.items() if not k.endswith("e_score_correction_bias")}
    hashed[f"{p}gate.tid2eid"] = torch.randint(0, CFG.num_experts, (20, CFG.top_k))  # int64 as in the HF shards
    layer = load_moe_layer(hashed, CFG, prefix=p, max_num_tokens=4)
    assert layer.hash_routed and layer.correction_bias is None
    ids = torch.tensor([3, 19])
    layer.forward(torch.randn(2, CFG.hidden_size).bfloat16(), ids)
    assert torch.equal(layer.last_routing[1], hashed[f"{p}gate.tid2eid"][ids].int())
    bad = {**hashed, f"{p}gate.tid2eid": hashed[f"{p}gate.tid2eid"] + CFG.num_experts}
    with pytest.raises(CheckpointError, match="tid2eid"):
        load_moe_layer(bad, CFG, prefix=p, max_num_tokens=4)
    bad = {**hashed, f"{p}gate.tid2eid": hashed[f"{p}gate.tid2eid"][:, :1]}
    with pytest.raises(CheckpointError, match="tid2eid"):
        load_moe_layer(bad, CFG, prefix=p, max_num_tokens=4)
    for value in (-1.0, 0.0, float("nan")):
        bad = {**layer_state, f"{p}experts.1.up_proj.weight_scale_2": torch.tensor(value)}
        with pytest.raises(CheckpointError, match="experts.1.up_proj.weight_scale_2"):
            load_moe_layer(bad, CFG, prefix=p, max_num_tokens=4)
        bad = {**layer_state, f"{p}shared_experts.down_proj.input_scale": torch.tensor(value)}
        with pytest.raises(CheckpointError, match="shared_experts.down_proj.input_scale"):
            load_moe_layer(bad, CFG, prefix=p, max_num_tokens=4)
