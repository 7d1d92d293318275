"""ModelOpt NVFP4 safetensors: write a small synthetic checkpoint, load it back, errors."""
import pytest
import torch
from safetensors.torch import save_file

from megamoe.checkpoint import CheckpointError, bf16_moe_state_dict, load_moe_layer, quantize_model_weights
from megamoe.layers import Nvfp4MoE
from megamoe.models import MoEConfig
from megamoe.reference.quantize import dequantize, quantize

CFG = MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2, shared_intermediate_size=32,
                name="ckpt-tiny")
PREFIX = "model.layers.3.mlp."


@pytest.fixture(scope="module")
def bf16_weights():
    _, w = Nvfp4MoE.random(CFG, seed=5, max_num_tokens=4, return_bf16=True)
    return w


def test_roundtrip_through_safetensors(tmp_path, bf16_weights):
    sd = quantize_model_weights(bf16_moe_state_dict(bf16_weights, CFG, PREFIX))
    assert sd[f"{PREFIX}experts.1.up_proj.weight"].dtype == torch.uint8
    path = tmp_path / "moe.safetensors"
    save_file(sd, str(path))
    layer = load_moe_layer(str(path), CFG, prefix=PREFIX, max_num_tokens=8)
    i = CFG.intermediate_size
    # decoded weights are exactly the per-projection NVFP4 quantization of the bf16 weights
    for e in (0, 3):
        w13_e = dequantize(layer.w13.__class__(layer.w13.data[e], layer.w13.block_scale[e],
                                               layer.w13.global_scale[e], layer.w13.shape[1:]), torch.float32)
        gate = dequantize(quantize(bf16_weights["w13"][e, :i]), torch.float32)
        up = dequantize(quantize(bf16_weights["w13"][e, i:]), torch.float32)
        assert torch.equal(w13_e, torch.cat((gate, up)))
    assert layer.w13.global_scale.shape == (CFG.num_experts, 2 * i, 1)  # gate/up scales differ -> per row
    x = torch.randn(5, CFG.hidden_size).bfloat16()
    out = layer.forward(x).clone()
    ref = layer.reference_forward(x, layer.last_routing)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_input_scales_become_static_w4a4_scales(bf16_weights):
    sd_bf16 = bf16_moe_state_dict(bf16_weights, CFG)
    modules = {n.rsplit(".", 1)[0] for n in sd_bf16 if n.endswith("_proj.weight")}
    scales = {m: 0.01 * (1 + idx) for idx, m in enumerate(sorted(modules))}
    sd = quantize_model_weights(sd_bf16, input_scales=scales)
    layer = load_moe_layer(sd, CFG, max_num_tokens=4, mode="w4a4")
    # one L1 scale for the routed experts and the (fused) shared expert: the max of their gate/up input scales
    l1_modules = [f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")]
    l1_expected = max(scales[m] for m in l1_modules + ["shared_experts.gate_proj", "shared_experts.up_proj"])
    assert layer.input_scales["l1"].item() == pytest.approx(l1_expected)
    assert layer.input_scales["l2"][2].item() == pytest.approx(scales["experts.2.down_proj"])
    assert layer.shared.input_scales["l2"].item() == pytest.approx(scales["shared_experts.down_proj"])
    x = torch.randn(3, CFG.hidden_size).bfloat16()
    out = layer.forward(x).clone()
    ref = layer.reference_forward(x, layer.last_routing)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-2  # w4a4 bound, see tests/layers


def test_missing_and_misshaped_tensors(bf16_weights):
    sd = quantize_model_weights(bf16_moe_state_dict(bf16_weights, CFG))
    broken = dict(sd)
    del broken["experts.2.down_proj.weight_scale"]
    with pytest.raises(CheckpointError, match="experts.2.down_proj.weight_scale"):
        load_moe_layer(broken, CFG, max_num_tokens=4)
    broken = dict(sd)
    broken["experts.0.gate_proj.weight"] = sd["experts.0.gate_proj.weight"][:, :-1]
    with pytest.raises(CheckpointError, match=r"experts.0.gate_proj.weight.*shape"):
        load_moe_layer(broken, CFG, max_num_tokens=4)
    broken = dict(sd)
    del broken["gate.e_score_correction_bias"]
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        load_moe_layer(broken, CFG, max_num_tokens=4)
    broken = dict(sd)
    broken["gate.weight"] = sd["gate.weight"][:3]
    with pytest.raises(ValueError, match="gate.weight"):
        load_moe_layer(broken, CFG, max_num_tokens=4)
