"""DeepSeek-V4-class MoE block configuration.

Sources of the constants (looked up 2026-11-23):

* ``DEEPSEEK_V4_FLASH``: the published ``config.json`` of
  ``deepseek-ai/DeepSeek-V4-Flash`` as quoted verbatim in public ports of the
  model (hidden_size 4096, moe_intermediate_size 2048, n_routed_experts 256,
  num_experts_per_tok 6, n_shared_experts 1, scoring_func "sqrtsoftplus",
  topk_method "noaux_tc" (a per-expert score-correction bias used for selection
  only), norm_topk_prob true, routed_scaling_factor 1.5, swiglu_limit 10.0).
  That config publishes no ``n_group`` / ``topk_group``: routing is flat top-k
  (``n_group = topk_group = 1``). Its first 3 layers are hash-routed
  (``num_hash_layers``), which is not modelled here.
* ``DEEPSEEK_V3_GUIDE``: the shapes of the project guide / DeepSeek-V3
  (hidden 7168, expert intermediate 2048, 256 experts, top-8, sigmoid scoring,
  8 groups with top-4 groups, routed_scaling_factor 2.5), kept because the
  project benchmarks were specified on them. The swiglu limit 10.0 is the
  seeds' default.
* ``SMALL``: an embedded CPU-sized configuration (same routing rules as V4-Flash)
  for tests and ``python -m megamoe run`` without a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing constants of one DeepSeek-style MoE block.

    hidden_size: H, the token width. intermediate_size: I, the routed experts'
    FFN width (gate_up has N = 2*I rows). num_experts: E routed experts.
    top_k: experts per token. shared_intermediate_size: width of the shared
    expert (``n_shared_experts * I``; 0 disables it). scoring_func: "sigmoid",
    "softmax" or "sqrtsoftplus" (``sqrt(softplus(logit))``). use_correction_bias:
    the layer holds ``e_score_correction_bias`` (E,) fp32, added to the scores for
    *selection only*. n_group / topk_group: group-limited routing (1/1 = flat).
    norm_topk_prob: renormalise the k selected weights to sum 1.
    routed_scaling_factor: multiplies the routed weights. swiglu_limit: clamp of
    the SwiGLU (None = no clamp).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    shared_intermediate_size: int
    scoring_func: str = "sqrtsoftplus"
    use_correction_bias: bool = True
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float | None = 10.0
    name: str = "custom"

    def __post_init__(self):
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        if self.hidden_size % 16 or self.intermediate_size % 16:
            raise ValueError(
                f"hidden_size and intermediate_size must be multiples of 16 (NVFP4 blocks), got "
                f"{self.hidden_size}, {self.intermediate_size}"
            )
        if self.shared_intermediate_size < 0 or self.shared_intermediate_size % 16:
            raise ValueError(
                f"shared_intermediate_size: expected 0 or a positive multiple of 16, got {self.shared_intermediate_size}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected <= num_experts={self.num_experts}, got {self.top_k}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group: must divide num_experts={self.num_experts}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1..n_group={self.n_group}, got {self.topk_group}")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError("topk_group groups hold fewer experts than top_k")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit: expected a positive number or None, got {self.swiglu_limit!r}")

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "hf") -> "MoEConfig":
        """Build from a Hugging Face ``config.json`` dict (DeepSeek-V3/V4 keys)."""
        moe_i = int(config["moe_intermediate_size"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=moe_i,
            num_experts=int(config["n_routed_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            shared_intermediate_size=moe_i * int(config.get("n_shared_experts", 0) or 0),
            scoring_func=config.get("scoring_func", "sigmoid"),
            use_correction_bias=config.get("topk_method", "noaux_tc") == "noaux_tc",
            n_group=int(config.get("n_group", 1) or 1),
            topk_group=int(config.get("topk_group", 1) or 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            swiglu_limit=(float(config["swiglu_limit"]) if config.get("swiglu_limit") else None),
            name=name,
        )


DEEPSEEK_V4_FLASH = MoEConfig(
    hidden_size=4096,
    intermediate_size=2048,
    num_experts=256,
    top_k=6,
    shared_intermediate_size=2048,
    scoring_func="sqrtsoftplus",
    use_correction_bias=True,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    name="deepseek-v4-flash",
)

DEEPSEEK_V3_GUIDE = MoEConfig(
    hidden_size=7168,
    intermediate_size=2048,
    num_experts=256,
    top_k=8,
    shared_intermediate_size=2048,
    scoring_func="sigmoid",
    use_correction_bias=True,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    swiglu_limit=10.0,
    name="guide-h7168-e256-top8",
)

SMALL = MoEConfig(
    hidden_size=256,
    intermediate_size=128,
    num_experts=8,
    top_k=2,
    shared_intermediate_size=128,
    scoring_func="sqrtsoftplus",
    use_correction_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    name="small-cpu",
)

PRESETS = {c.name: c for c in (DEEPSEEK_V4_FLASH, DEEPSEEK_V3_GUIDE, SMALL)}
PRESETS.update({"v4-flash": DEEPSEEK_V4_FLASH, "guide": DEEPSEEK_V3_GUIDE, "small": SMALL})
