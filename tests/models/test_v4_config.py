"""Whole-model V4Config: presets vs the published config.json values, from_hf_config and its errors."""
import copy

import pytest

from megamoe.models.config import (
    DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO, MODEL_PRESETS, PRESETS, V4_FLASH_MODEL, V4_PRO_MODEL, MoEConfig, V4Config,
)

# The keys of the published DeepSeek-V4-Flash config.json that this package reads (values: module docstring table).
FLASH_JSON = {
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
}
PRO_JSON = {**FLASH_JSON, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "q_lora_rank": 1536, "o_groups": 16, "index_topk": 1024, "moe_intermediate_size": 3072,
            "n_routed_experts": 384, "routed_scaling_factor": 2.5,
            "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]}


def _same_model(a: V4Config, b: V4Config) -> None:
    assert a.replace(name="x", moe=a.moe.replace(name="x")) == b.replace(name="x", moe=b.moe.replace(name="x"))


@pytest.mark.parametrize("js,preset", [(FLASH_JSON, V4_FLASH_MODEL), (PRO_JSON, V4_PRO_MODEL)])
def test_presets_equal_published_config(js, preset):
    _same_model(V4Config.from_hf_config(js), preset)


def test_pro_and_flash_constants():
    p = V4_PRO_MODEL
    assert (p.hidden_size, p.num_layers, p.num_heads, p.q_lora_rank, p.o_groups, p.o_lora_rank, p.index_topk) == (
        7168, 61, 128, 1536, 16, 1024, 1024)
    assert p.compress_ratios[:3] == (128, 128, 4) and p.compress_ratios[-1] == 4
    assert [p.layer_kind(i) for i in range(4)] == ["hca", "hca", "csa", "hca"]
    m = DEEPSEEK_V4_PRO
    assert (m.hidden_size, m.intermediate_size, m.num_experts, m.top_k, m.shared_intermediate_size) == (
        7168, 3072, 384, 6, 3072)
    assert (m.scoring_func, m.routed_scaling_factor, m.swiglu_limit, m.n_group) == ("sqrtsoftplus", 2.5, 10.0, 1)
    f = V4_FLASH_MODEL
    assert (f.vocab_size, f.compress_rope_theta, f.rope_factor, f.original_seq_len, f.beta_fast, f.beta_slow) == (
        129280, 160000.0, 16.0, 65536, 32, 1)
    assert f.max_position_embeddings == 1048576 and f.num_mtp_layers == 1 and f.moe == DEEPSEEK_V4_FLASH
    assert PRESETS["v4-pro"] is DEEPSEEK_V4_PRO and MODEL_PRESETS["v4-pro"] is V4_PRO_MODEL


def test_extra_ratio_entries_are_ignored_and_short_lists_rejected():
    js = {**FLASH_JSON, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]}  # a 46-entry (DSpark) variant
    _same_model(V4Config.from_hf_config(js), V4_FLASH_MODEL)
    with pytest.raises(ValueError, match="compress_ratios"):
        V4Config.from_hf_config({**FLASH_JSON, "compress_ratios": [0] * 42})


REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_hash_layers", "num_attention_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios",
            "rope_theta", "compress_rope_theta", "rope_scaling", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "max_position_embeddings",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"]


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_key_is_a_value_error_naming_it(key):
    js = copy.deepcopy(FLASH_JSON)
    del js[key]
    with pytest.raises(ValueError, match=key):
        V4Config.from_hf_config(js)


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow"])
def test_missing_rope_scaling_key(key):
    js = copy.deepcopy(FLASH_JSON)
    del js["rope_scaling"][key]
    with pytest.raises(ValueError, match=f"rope_scaling.{key}"):
        V4Config.from_hf_config(js)


def test_bad_values():
    with pytest.raises(ValueError, match="yarn"):
        V4Config.from_hf_config({**FLASH_JSON, "rope_scaling": {**FLASH_JSON["rope_scaling"], "type": "linear"}})
    with pytest.raises(ValueError, match="hidden_size"):
        V4Config.from_hf_config({**FLASH_JSON, "hidden_size": "4096"})
    with pytest.raises(TypeError, match="dict"):
        V4Config.from_hf_config([("hidden_size", 4096)])
    with pytest.raises(ValueError, match="max_seq_len"):
        V4Config.from_hf_config(FLASH_JSON, max_seq_len=2 ** 21)
    assert V4Config.from_hf_config(FLASH_JSON, max_seq_len=4096).max_seq_len == 4096


def test_moe_config_errors():
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        MoEConfig.from_hf_config({})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig.from_hf_config({k: v for k, v in FLASH_JSON.items() if k != "num_experts_per_tok"})
    with pytest.raises(TypeError, match="shared_intermediate_size"):
        MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, shared_intermediate_size=None)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        DEEPSEEK_V4_FLASH.replace(routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="fewer experts than top_k"):
        MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=5, shared_intermediate_size=0,
                  n_group=4, topk_group=2)
    # null / 0 group keys mean flat routing; a null scaling factor means 1.0
    c = MoEConfig.from_hf_config({**FLASH_JSON, "n_group": None, "topk_group": 0, "routed_scaling_factor": None})
    assert (c.n_group, c.topk_group, c.routed_scaling_factor) == (1, 1, 1.0)


@pytest.mark.parametrize("iters", ["-1", "0"])
def test_run_rejects_non_positive_iters(iters, capsys):
    from megamoe.cli import main

    assert main(["run", "--iters", iters]) != 0
    assert "--iters" in capsys.readouterr().out
