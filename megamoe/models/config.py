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


# ==============================================================================================================
# Whole-model configuration (DeepSeek-V4)
# ==============================================================================================================
#: Layer kinds by ``compress_ratios`` entry: 0 -> sliding window only, 4 -> CSA (overlapping compressor + indexer),
#: anything else > 0 -> HCA (plain compressor, all entries attended). Official ``Attention.__init__`` /
#: ``Compressor.__init__``: ``overlap = compress_ratio == 4``; an ``Indexer`` only when ``compress_ratio == 4``.
CSA_RATIO = 4


def layer_kind(compress_ratio: int) -> str:
    """"window", "csa" or "hca" for one ``compress_ratios`` entry."""
    if compress_ratio == 0:
        return "window"
    return "csa" if compress_ratio == CSA_RATIO else "hca"


@dataclass(frozen=True)
class V4Config:
    """Shapes and constants of a whole DeepSeek-V4 model (official ``ModelArgs`` names in brackets).

    vocab_size; hidden_size [dim]; num_layers [n_layers]; num_hash_layers [n_hash_layers]: the first layers
    route by a token-id -> expert table; num_heads [n_heads] query heads sharing one kv head of head_dim
    (the last rope_dim dims rotary); q_lora_rank; o_groups x o_lora_rank: the grouped output projection;
    window_size; compress_ratios: one entry per layer (see :func:`layer_kind`); rope_theta (window-only layers,
    no YaRN) and compress_rope_theta with YaRN (rope_factor, original_seq_len, beta_fast, beta_slow) for
    compressed layers; index_n_heads x index_head_dim, index_topk: the CSA indexer; hc_mult,
    hc_sinkhorn_iters, hc_eps: hyper-connections; norm_eps; max_seq_len: the longest request this instance
    serves (sizes caches and RoPE tables); num_mtp_layers: multi-token-prediction blocks in the checkpoint
    (not run by default); moe: the MoE block (:class:`MoEConfig`).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_hash_layers: int
    num_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple
    moe: MoEConfig
    head_dim: int = 512
    rope_dim: int = 64
    window_size: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    max_seq_len: int = 65536
    num_mtp_layers: int = 1

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank",
                  "head_dim", "rope_dim", "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                  "hc_sinkhorn_iters", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(f"compress_ratios: expected {self.num_layers} entries (one per layer), got "
                             f"{len(self.compress_ratios)}")
        if any(r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios: expected entries >= 0, got {self.compress_ratios}")
        if not 0 <= self.num_hash_layers <= self.num_layers:
            raise ValueError(f"num_hash_layers: expected 0..{self.num_layers}, got {self.num_hash_layers}")
        if self.rope_dim >= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim: expected an even number < head_dim={self.head_dim}, got {self.rope_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups: must divide num_heads * head_dim = {self.num_heads * self.head_dim}")
        if self.index_head_dim & (self.index_head_dim - 1) or self.index_head_dim % 32:
            raise ValueError(f"index_head_dim: expected a power of two >= 32 (Hadamard, FP4 blocks of 32), got "
                             f"{self.index_head_dim}")
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"moe.hidden_size={self.moe.hidden_size} != hidden_size={self.hidden_size}")

    def replace(self, **changes) -> "V4Config":
        return dataclasses.replace(self, **changes)

    def layer_kind(self, layer: int) -> str:
        return layer_kind(self.compress_ratios[layer])

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


def _v4_ratios(num_layers: int) -> tuple:
    """V4-Flash's published pattern: two window-only layers, then CSA / HCA alternating, CSA last."""
    body = [CSA_RATIO if i % 2 == 0 else 128 for i in range(num_layers - 2)]
    return tuple([0, 0] + body)


V4_FLASH_MODEL = V4Config(
    name="deepseek-v4-flash", vocab_size=129280, hidden_size=4096, num_layers=43, num_hash_layers=3, num_heads=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, compress_ratios=_v4_ratios(43), moe=DEEPSEEK_V4_FLASH,
    index_topk=512,
)

V4_TINY_MOE = MoEConfig(hidden_size=128, intermediate_size=64, num_experts=8, top_k=2, shared_intermediate_size=64,
                        scoring_func="sqrtsoftplus", use_correction_bias=True, norm_topk_prob=True,
                        routed_scaling_factor=1.5, swiglu_limit=10.0, name="v4-tiny-moe")

#: CPU-sized model with every layer kind: window (0), CSA (4), HCA (ratio 16 stands in for 128 so that short
#: prompts reach it), hash routing in layer 0. Not a published model.
V4_TINY_MODEL = V4Config(
    name="v4-tiny", vocab_size=512, hidden_size=128, num_layers=4, num_hash_layers=1, num_heads=4, head_dim=128,
    rope_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, compress_ratios=(0, 4, 16, 4), moe=V4_TINY_MOE,
    window_size=16, index_n_heads=4, index_head_dim=64, index_topk=8, original_seq_len=128, max_seq_len=512,
    num_mtp_layers=0,
)

MODEL_PRESETS = {"v4-flash": V4_FLASH_MODEL, "tiny": V4_TINY_MODEL}
