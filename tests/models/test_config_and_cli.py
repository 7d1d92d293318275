"""DeepSeek-V4 config presets and the `python -m megamoe run` job on CPU."""
import pytest

from megamoe.models import DEEPSEEK_V4_FLASH, MoEConfig


def test_v4_flash_constants_and_validation():
    c = DEEPSEEK_V4_FLASH
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k) == (4096, 2048, 256, 6)
    assert c.scoring_func == "sqrtsoftplus" and c.routed_scaling_factor == 1.5 and c.swiglu_limit == 10.0
    hf = {"hidden_size": 4096, "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6,
          "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
          "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0}
    assert MoEConfig.from_hf_config(hf, name=c.name) == c
    with pytest.raises(ValueError, match="top_k"):
        c.replace(top_k=300)
    with pytest.raises(ValueError, match="scoring_func"):
        c.replace(scoring_func="relu")


def test_run_command_on_cpu(capsys, monkeypatch):
    from megamoe.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU references, as `python -m megamoe run` on CPU uses

    assert main(["run", "--tokens", "3", "--iters", "1"]) == 0
    text = capsys.readouterr().out
    assert "relative error" in text and "time per call" in text
