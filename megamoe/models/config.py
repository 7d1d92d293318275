"""DeepSeek-V4-class configurations: the MoE block (:class:`MoEConfig`) and the whole model (:class:`V4Config`).

Constants and where each one comes from (checked 2026-11-23)
------------------------------------------------------------

"Flash cfg" / "Pro cfg" are the published ``config.json`` of ``deepseek-ai/DeepSeek-V4-Flash`` / ``-V4-Pro`` as
quoted verbatim in public repositories (find_string ``"num_hash_layers": 3`` and ``"o_groups": 16``: a Rust
port embedding the Flash file byte for byte with its sha256, an S3 upload script embedding the Pro file, several
test fixtures and model-spec tables agreeing with both). "model.py" is the official ``inference/model.py``
(``ModelArgs``, ``Gate``, ``MoE``, ``Attention``).

==================================  ==============  ==============  ===============================================
constant (config.json key)          V4-Flash        V4-Pro          source / note
==================================  ==============  ==============  ===============================================
vocab_size                          129280          129280          Flash cfg, Pro cfg; ModelArgs default 129280
hidden_size                         4096            7168            Flash cfg, Pro cfg
num_hidden_layers                   43              61              Flash cfg, Pro cfg
num_hash_layers                     3               3               both cfgs; model.py ``Gate``: ``hash = layer_id
                                                                    < n_hash_layers`` (tid2eid (vocab, top_k) int32,
                                                                    no bias)
num_attention_heads                 64              128             both cfgs (num_key_value_heads 1)
head_dim / qk_rope_head_dim         512 / 64        512 / 64        both cfgs
q_lora_rank                         1024            1536            both cfgs
o_groups / o_lora_rank              8 / 1024        16 / 1024       both cfgs
sliding_window                      128             128             both cfgs (``window_size`` in model.py)
compress_ratios                     [0,0]+[4,128]   [128,128]+      both cfgs. The published lists have
                                    *20+[4], +[0]   [4,128]*29+     num_layers + num_nextn_predict_layers entries
                                                    [4], +[0]       (44 / 62); the trailing 0 is the MTP block's.
                                                                    A "-0731" Flash variant ships 46 (3 DSpark
                                                                    stages); only the first num_layers are layers.
rope_theta                          10000           10000           both cfgs (window-only layers, no YaRN)
compress_rope_theta                 160000          160000          both cfgs (ModelArgs' default 40000 is
                                                                    overridden by the config; one training port
                                                                    uses 40000 for Flash, the config says 160000)
rope_scaling.factor                 16              16              both cfgs (``rope_factor``)
rope_scaling.original_max_pos...    65536           65536           both cfgs (``original_seq_len``)
rope_scaling.beta_fast / beta_slow  32 / 1          32 / 1          both cfgs, type "yarn"
max_position_embeddings             1048576         1048576         both cfgs (the model's limit; ``max_seq_len``
                                                                    below is what one instance serves)
index_n_heads / index_head_dim      64 / 128        64 / 128        both cfgs
index_topk                          512             1024            both cfgs
hc_mult / hc_sinkhorn_iters         4 / 20          4 / 20          both cfgs
hc_eps / rms_norm_eps               1e-6 / 1e-6     1e-6 / 1e-6     both cfgs
num_nextn_predict_layers            1               1               both cfgs
moe_intermediate_size               2048            3072            both cfgs
n_routed_experts                    256             384             both cfgs
num_experts_per_tok                 6               6               both cfgs
n_shared_experts                    1               1               both cfgs; model.py asserts 1 and builds it with
                                                                    ``moe_inter_dim`` (shared width = I)
scoring_func                        sqrtsoftplus    sqrtsoftplus    both cfgs; model.py ``F.softplus(s).sqrt()``
topk_method                         noaux_tc        noaux_tc        both cfgs (score-correction bias, selection
                                                                    only; hash layers have no bias)
norm_topk_prob                      true            true            both cfgs
routed_scaling_factor               1.5             2.5             both cfgs (``route_scale``)
swiglu_limit                        10.0            10.0            both cfgs
n_group / topk_group                (absent) 1/1    (absent) 1/1    neither config has them: flat top-k
==================================  ==============  ==============  ===============================================

Other presets: ``DEEPSEEK_V3_GUIDE`` has the shapes of the project guide / DeepSeek-V3 (hidden 7168, expert
intermediate 2048, 256 experts, top-8, sigmoid scoring, 8 groups with top-4 groups, routed_scaling_factor 2.5),
kept because the project benchmarks were specified on them (swiglu limit 10.0: the seeds' default). ``SMALL`` and
``V4_TINY_*`` are CPU-sized configurations with V4 routing rules, not published models.
"""
from __future__ import annotations

import dataclasses
import math
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

    Weight normalisation vs the official DeepSeek-V4 code: its ``Gate.forward``
    renormalises the k weights whenever ``score_func != "softmax"`` and never
    for softmax, ignoring ``norm_topk_prob``; this package follows
    ``norm_topk_prob`` for every scoring function (the Hugging Face / DeepSeek-V3
    convention). The two agree for V4-Flash and V4-Pro (sqrtsoftplus with
    ``norm_topk_prob: true``); they differ only for a sigmoid/sqrtsoftplus config
    with ``norm_topk_prob: false`` or a softmax config with ``true``. The same
    rule applies to hash-routed layers (the first ``num_hash_layers`` of a
    V4 model), whose weights are the scores gathered at the table's ids.
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
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group",
                      "shared_intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{field}: expected an int, got {type(value).__name__} {value!r}")
            if value < (0 if field == "shared_intermediate_size" else 1):
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        if not isinstance(self.routed_scaling_factor, (int, float)) or isinstance(self.routed_scaling_factor, bool) \
                or not math.isfinite(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor: expected a finite number, got {self.routed_scaling_factor!r}")
        if self.hidden_size % 16 or self.intermediate_size % 16:
            raise ValueError(
                f"hidden_size and intermediate_size must be multiples of 16 (NVFP4 blocks), got "
                f"{self.hidden_size}, {self.intermediate_size}"
            )
        if self.shared_intermediate_size < 0 or self.shared_intermediate_size % 16:
            raise ValueError(
                f"shared_intermediate_size: expected 0 or a positive multiple of 16, "
                f"got {self.shared_intermediate_size}"
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
        """Build from a Hugging Face ``config.json`` dict (DeepSeek-V3/V4 keys).

        Required: hidden_size, moe_intermediate_size, n_routed_experts,
        num_experts_per_tok (a missing one -> ValueError naming it). Optional, with
        defaults: n_shared_experts 0, scoring_func "sigmoid", topk_method
        "noaux_tc", n_group / topk_group 1 (0 or null also mean 1),
        norm_topk_prob true, routed_scaling_factor 1.0, swiglu_limit none.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict (config.json), got {type(config).__name__}")
        moe_i = _hf_int(config, "moe_intermediate_size")
        scaling = config.get("routed_scaling_factor", 1.0)
        return cls(
            hidden_size=_hf_int(config, "hidden_size"),
            intermediate_size=moe_i,
            num_experts=_hf_int(config, "n_routed_experts"),
            top_k=_hf_int(config, "num_experts_per_tok"),
            shared_intermediate_size=moe_i * int(config.get("n_shared_experts", 0) or 0),
            scoring_func=config.get("scoring_func", "sigmoid"),
            use_correction_bias=config.get("topk_method", "noaux_tc") == "noaux_tc",
            n_group=int(config.get("n_group", 1) or 1),
            topk_group=int(config.get("topk_group", 1) or 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(1.0 if scaling is None else scaling),
            swiglu_limit=(float(config["swiglu_limit"]) if config.get("swiglu_limit") else None),
            name=name,
        )


def _hf_require(config: dict, key: str):
    if key not in config or config[key] is None:
        raise ValueError(f"config.json: missing required key {key!r}")
    return config[key]


def _hf_int(config: dict, key: str) -> int:
    value = _hf_require(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"config.json: {key!r} must be an integer, got {value!r}")
    return int(value)


def _hf_float(config: dict, key: str) -> float:
    value = _hf_require(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json: {key!r} must be a number, got {value!r}")
    return float(value)


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

DEEPSEEK_V4_PRO = MoEConfig(
    hidden_size=7168,
    intermediate_size=3072,
    num_experts=384,
    top_k=6,
    shared_intermediate_size=3072,
    scoring_func="sqrtsoftplus",
    use_correction_bias=True,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    swiglu_limit=10.0,
    name="deepseek-v4-pro",
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

PRESETS = {c.name: c for c in (DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO, DEEPSEEK_V3_GUIDE, SMALL)}
PRESETS.update({"v4-flash": DEEPSEEK_V4_FLASH, "v4-pro": DEEPSEEK_V4_PRO, "guide": DEEPSEEK_V3_GUIDE,
                "small": SMALL})


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
    serves (sizes caches and RoPE tables), at most max_position_embeddings (the model's limit, from
    config.json); num_mtp_layers [n_mtp_layers / num_nextn_predict_layers]: multi-token-prediction blocks in the
    checkpoint (not run by default); moe: the MoE block (:class:`MoEConfig`). Constants and sources: the module
    docstring. :meth:`from_hf_config` builds one from a ``config.json`` dict.
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
    max_position_embeddings: int = 1048576

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank",
                  "head_dim", "rope_dim", "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                  "hc_sinkhorn_iters", "max_seq_len", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        for f in ("num_hash_layers", "num_mtp_layers", "original_seq_len", "beta_fast", "beta_slow"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}: expected an int >= 0, got {v!r}")
        for f in ("rope_theta", "compress_rope_theta", "rope_factor", "hc_eps", "norm_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f}: expected a positive finite number, got {v!r}")
        if self.max_seq_len > self.max_position_embeddings:
            raise ValueError(f"max_seq_len: expected <= max_position_embeddings={self.max_position_embeddings}, "
                             f"got {self.max_seq_len}")
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

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "hf", *, max_seq_len: int | None = None) -> "V4Config":
        """Build from a DeepSeek-V4 ``config.json`` dict (Hugging Face key names; see the module table).

        Required keys (a missing one -> ValueError naming it): vocab_size, hidden_size, num_hidden_layers,
        num_hash_layers, num_attention_heads, head_dim, qk_rope_head_dim, q_lora_rank, o_groups, o_lora_rank,
        sliding_window, compress_ratios (at least num_hidden_layers entries; the first num_hidden_layers are
        the layers, the rest belong to the MTP / DSpark blocks), rope_theta, compress_rope_theta, rope_scaling
        {factor, original_max_position_embeddings, beta_fast, beta_slow} (type "yarn" when given),
        index_n_heads, index_head_dim, index_topk, hc_mult, hc_sinkhorn_iters, hc_eps, rms_norm_eps,
        max_position_embeddings, and the MoE keys of :meth:`MoEConfig.from_hf_config`.
        num_nextn_predict_layers defaults to 0. max_seq_len (a serving choice, not in the file): default
        ``min(65536, max_position_embeddings)``.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict (config.json), got {type(config).__name__}")
        num_layers = _hf_int(config, "num_hidden_layers")
        ratios = _hf_require(config, "compress_ratios")
        if not isinstance(ratios, (list, tuple)) or len(ratios) < num_layers:
            raise ValueError(f"config.json: 'compress_ratios' must list at least num_hidden_layers={num_layers} "
                             f"entries, got {ratios!r}")
        rope = _hf_require(config, "rope_scaling")
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: 'rope_scaling' must be an object, got {rope!r}")
        rope_type = rope.get("type", rope.get("rope_type", "yarn"))
        if rope_type != "yarn":
            raise ValueError(f"config.json: rope_scaling type must be 'yarn', got {rope_type!r}")
        rope = {f"rope_scaling.{k}": v for k, v in rope.items()}
        max_pos = _hf_int(config, "max_position_embeddings")
        return cls(
            name=name,
            vocab_size=_hf_int(config, "vocab_size"),
            hidden_size=_hf_int(config, "hidden_size"),
            num_layers=num_layers,
            num_hash_layers=_hf_int(config, "num_hash_layers"),
            num_heads=_hf_int(config, "num_attention_heads"),
            q_lora_rank=_hf_int(config, "q_lora_rank"),
            o_groups=_hf_int(config, "o_groups"),
            o_lora_rank=_hf_int(config, "o_lora_rank"),
            compress_ratios=tuple(int(r) for r in ratios[:num_layers]),
            moe=MoEConfig.from_hf_config(config, name=f"{name}-moe"),
            head_dim=_hf_int(config, "head_dim"),
            rope_dim=_hf_int(config, "qk_rope_head_dim"),
            window_size=_hf_int(config, "sliding_window"),
            rope_theta=_hf_float(config, "rope_theta"),
            compress_rope_theta=_hf_float(config, "compress_rope_theta"),
            rope_factor=_hf_float(rope, "rope_scaling.factor"),
            original_seq_len=_hf_int(rope, "rope_scaling.original_max_position_embeddings"),
            beta_fast=_hf_int(rope, "rope_scaling.beta_fast"),
            beta_slow=_hf_int(rope, "rope_scaling.beta_slow"),
            index_n_heads=_hf_int(config, "index_n_heads"),
            index_head_dim=_hf_int(config, "index_head_dim"),
            index_topk=_hf_int(config, "index_topk"),
            hc_mult=_hf_int(config, "hc_mult"),
            hc_sinkhorn_iters=_hf_int(config, "hc_sinkhorn_iters"),
            hc_eps=_hf_float(config, "hc_eps"),
            norm_eps=_hf_float(config, "rms_norm_eps"),
            max_seq_len=min(65536, max_pos) if max_seq_len is None else max_seq_len,
            num_mtp_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
            max_position_embeddings=max_pos,
        )

    def layer_kind(self, layer: int) -> str:
        return layer_kind(self.compress_ratios[layer])

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


def _v4_ratios(num_layers: int, first: int = 0) -> tuple:
    """The published patterns: two leading layers of ratio ``first`` (Flash: 0 = window only, Pro: 128 = HCA),
    then CSA / HCA alternating, CSA last."""
    body = [CSA_RATIO if i % 2 == 0 else 128 for i in range(num_layers - 2)]
    return tuple([first, first] + body)


V4_FLASH_MODEL = V4Config(
    name="deepseek-v4-flash", vocab_size=129280, hidden_size=4096, num_layers=43, num_hash_layers=3, num_heads=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, compress_ratios=_v4_ratios(43), moe=DEEPSEEK_V4_FLASH,
    index_topk=512,
)

V4_PRO_MODEL = V4Config(
    name="deepseek-v4-pro", vocab_size=129280, hidden_size=7168, num_layers=61, num_hash_layers=3, num_heads=128,
    q_lora_rank=1536, o_groups=16, o_lora_rank=1024, compress_ratios=_v4_ratios(61, first=128),
    moe=DEEPSEEK_V4_PRO, index_topk=1024,
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

MODEL_PRESETS = {"v4-flash": V4_FLASH_MODEL, "v4-pro": V4_PRO_MODEL, "tiny": V4_TINY_MODEL}
