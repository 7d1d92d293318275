"""DeepSeek-V4 weight specification: official names and shapes, ModelOpt NVFP4 storage, random checkpoints."""
import pytest
import torch

from megamoe.format.e2m1 import e2m1_decode
from megamoe.models.config import V4_FLASH_MODEL, V4_TINY_MODEL
from megamoe.models.v4_weights import (
    DecodedView,
    WeightSpec,
    check_state_dict,
    decoded_state_dict,
    decoded_weight,
    nvfp4_weight,
    random_state_dict,
    weight_specs,
)
from megamoe.reference.quantize import dequantize

TINY = V4_TINY_MODEL.replace(num_layers=3, compress_ratios=(0, 4, 8), index_head_dim=128)


def test_v4_flash_shapes_follow_the_official_modules():
    c = V4_FLASH_MODEL
    assert c.compress_ratios[:4] == (0, 0, 4, 128)
    s = weight_specs(c, layers=[0, 2, 3])
    shape = {n: (sp.shape, sp.kind) for n, sp in s.items()}
    assert shape["embed.weight"] == ((129280, 4096), "bf16") and shape["head.weight"] == ((129280, 4096), "bf16")
    assert shape["hc_head_fn"] == ((4, 16384), "fp32") and shape["hc_head_scale"] == ((1,), "fp32")
    assert shape["layers.0.hc_attn_fn"] == ((24, 16384), "fp32") and shape["layers.0.hc_ffn_base"] == ((24,), "fp32")
    assert shape["layers.0.hc_ffn_scale"] == ((3,), "fp32")
    assert shape["layers.3.attn.attn_sink"] == ((64,), "fp32")
    assert shape["layers.3.attn.wq_a.weight"] == ((1024, 4096), "nvfp4")
    assert shape["layers.3.attn.wq_b.weight"] == ((64 * 512, 1024), "nvfp4")
    assert shape["layers.3.attn.wkv.weight"] == ((512, 4096), "nvfp4")
    assert shape["layers.3.attn.wo_a.weight"] == ((8 * 1024, 64 * 512 // 8), "nvfp4")
    assert shape["layers.3.attn.wo_b.weight"] == ((4096, 8 * 1024), "nvfp4")
    # window-only layer: no compressor; CSA (ratio 4): overlapping compressor (coff 2) + indexer; HCA: coff 1
    assert not any(".compressor." in n or ".indexer." in n for n in s if n.startswith("layers.0."))
    assert shape["layers.2.attn.compressor.ape"] == ((4, 1024), "fp32")
    assert shape["layers.2.attn.compressor.wkv.weight"] == ((1024, 4096), "bf16")
    assert shape["layers.2.attn.compressor.wgate.weight"] == ((1024, 4096), "bf16")
    assert shape["layers.2.attn.compressor.norm.weight"] == ((512,), "bf16")
    assert shape["layers.2.attn.indexer.wq_b.weight"] == ((64 * 128, 1024), "nvfp4")
    assert shape["layers.2.attn.indexer.weights_proj.weight"] == ((64, 4096), "bf16")
    assert shape["layers.2.attn.indexer.compressor.ape"] == ((4, 256), "fp32")
    assert shape["layers.2.attn.indexer.compressor.wkv.weight"] == ((256, 4096), "bf16")
    assert shape["layers.2.attn.indexer.compressor.norm.weight"] == ((128,), "bf16")
    assert shape["layers.3.attn.compressor.ape"] == ((128, 512), "fp32")
    assert shape["layers.3.attn.compressor.wkv.weight"] == ((512, 4096), "bf16")
    assert not any(".indexer." in n for n in s if n.startswith("layers.3."))
    # routing: hash layers (0..2) carry tid2eid and no bias, later layers a bias
    assert shape["layers.0.ffn.gate.tid2eid"] == ((129280, 6), "int32") and "layers.0.ffn.gate.bias" not in s
    assert shape["layers.3.ffn.gate.bias"] == ((256,), "fp32") and "layers.3.ffn.gate.tid2eid" not in s
    assert shape["layers.3.ffn.gate.weight"] == ((256, 4096), "bf16")
    assert shape["layers.3.ffn.experts.255.w1.weight"] == ((2048, 4096), "nvfp4")
    assert shape["layers.3.ffn.experts.255.w2.weight"] == ((4096, 2048), "nvfp4")
    assert shape["layers.3.ffn.experts.0.w3.weight"] == ((2048, 4096), "nvfp4")
    assert shape["layers.3.ffn.shared_experts.w2.weight"] == ((4096, 2048), "nvfp4")
    assert sum(n.startswith("layers.3.ffn.experts.") for n in s) == 256 * 3
    assert len(weight_specs(c)) == 6 + sum(len(weight_specs(c, layers=[i])) - 6 for i in range(c.num_layers))
    with pytest.raises(ValueError, match="layers"):
        weight_specs(c, layers=[43])


def test_nvfp4_storage_convention():
    spec = WeightSpec("layers.1.attn.wq_b.weight", (256, 64), "nvfp4")
    assert spec.stored() == {
        "layers.1.attn.wq_b.weight": ((256, 32), torch.uint8),
        "layers.1.attn.wq_b.weight_scale": ((256, 4), torch.float8_e4m3fn),
        "layers.1.attn.wq_b.weight_scale_2": ((), torch.float32),
    }
    assert WeightSpec("norm.weight", (8,), "bf16").stored() == {"norm.weight": ((8,), torch.bfloat16)}


def test_random_state_dict_matches_specs_and_decodes_exactly():
    sd = random_state_dict(TINY, seed=3)
    check_state_dict(TINY, sd)
    specs = weight_specs(TINY)
    stored = {n for s in specs.values() for n in s.stored()}
    assert set(sd) == stored
    name = "layers.1.attn.wq_b.weight"
    t = nvfp4_weight(sd, name)
    w = decoded_weight(sd, name)
    assert w.dtype == torch.float32 and w.shape == specs[name].shape
    assert torch.equal(w, dequantize(t, torch.float32))
    # low nibble = even element: w[r, 0] = e2m1(data[r, 0] & 15) * (weight_scale * weight_scale_2), w[r, 1] from
    # the high nibble
    scale = sd[name + "_scale"][:, 0].float() * sd[name + "_scale_2"]
    assert torch.equal(w[:, 0], e2m1_decode(sd[name][:, 0] & 15) * scale)
    assert torch.equal(w[:, 1], e2m1_decode(sd[name][:, 0] >> 4) * scale)
    # realistic scales
    fan_in = specs[name].shape[1]
    assert 0.8 < w.std().item() * fan_in ** 0.5 < 1.2
    norm = decoded_weight(sd, "layers.2.attn.kv_norm.weight")
    assert norm.dtype == torch.float32 and 0.85 < norm.mean().item() < 1.15 and norm.std().item() < 0.2
    fn = sd["layers.1.hc_attn_fn"]
    assert fn.dtype == torch.float32 and fn.std().item() < 0.02
    assert sd["layers.1.attn.attn_sink"].dtype == torch.float32
    tid = sd["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int32 and tid.shape == (TINY.vocab_size, TINY.moe.top_k)
    assert int(tid.min()) >= 0 and int(tid.max()) < TINY.moe.num_experts
    assert (tid[:, 0] != tid[:, 1]).all()
    assert "layers.0.ffn.gate.bias" not in sd and sd["layers.1.ffn.gate.bias"].dtype == torch.float32


def test_layer_subsets_and_seeds():
    full = random_state_dict(TINY, seed=5)
    part = random_state_dict(TINY, seed=5, layers=[2])
    assert not any(n.startswith(("layers.0.", "layers.1.")) for n in part)
    assert "embed.weight" in part and "layers.2.attn.compressor.ape" in part
    for n, t in part.items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           full[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else full[n]), n
    other = random_state_dict(TINY, seed=6, layers=[2])
    assert not torch.equal(other["layers.2.attn.compressor.ape"], part["layers.2.attn.compressor.ape"])
    check_state_dict(TINY, part, layers=[2])


def test_decoded_state_dict_and_checks():
    sd = random_state_dict(TINY, seed=1, layers=[1])
    dec = decoded_state_dict(sd)
    assert set(dec) == set(weight_specs(TINY, layers=[1]))
    assert dec["layers.1.ffn.experts.3.w2.weight"].shape == (TINY.hidden_size, TINY.moe.intermediate_size)
    assert all(t.dtype == torch.float32 for t in dec.values())
    broken = dict(sd)
    del broken["layers.1.attn.wkv.weight_scale"]
    broken["layers.1.attn.attn_sink"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"attn_sink: shape \(3,\), expected \(4,\).*wkv\.weight_scale: missing"):
        check_state_dict(TINY, broken, layers=[1])


def test_decoded_view_and_select():
    sd = random_state_dict(TINY, seed=2, layers=[1], select=lambda n: ".attn." in n)
    assert sd and all(".attn." in n for n in sd)
    view = DecodedView(sd)
    eager = decoded_state_dict(sd)
    assert set(view) == set(eager) and len(view) == len(eager)
    for n in eager:
        assert torch.equal(view[n], eager[n])
    with pytest.raises(KeyError):
        view["layers.1.attn.wq_a.weight_scale_9"]
