"""One DeepSeek-V4 decoder layer: hyper-connections around the attention block and the MoE block.

Official ``Block.forward``: the residual stream is ``hc_mult`` copies (T, hc, dim);
``x, post, comb = hc_pre(h)``, ``x = attn_norm(x)``, ``x = attn(x)``, ``h = hc_post(x, h, post, comb)``; then the
same around ``ffn_norm`` and the MoE. The first ``num_hash_layers`` layers route experts by token id.
"""
from __future__ import annotations

import torch

from ..checkpoint.modelopt import read_experts, read_nvfp4_linear, read_shared_expert
from ..format.tensor import NVFP4Tensor
from ..layers.attention import Nvfp4Attention
from ..layers.moe import Nvfp4MoE
from ..ops import hyper_connection as hc_ops
from ..ops._dispatch import resolve_device
from .config import V4Config

#: Hyper-connection parameters of a layer (official ``Block.__init__``), fp32.
HC_NAMES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")


def nvfp4_from_checkpoint(tensors, name: str, out_features: int, in_features: int) -> NVFP4Tensor:
    """The ModelOpt NVFP4 linear ``name`` (``name.weight`` / ``.weight_scale`` / ``.weight_scale_2``)."""
    return read_nvfp4_linear(tensors, name, out_features, in_features)[0]


def linear_from_checkpoint(tensors, name: str, out_features: int, in_features: int):
    """An NVFP4Tensor when the checkpoint stores ``name`` as ModelOpt NVFP4, else the bf16/fp32 tensor."""
    if f"{name}.weight_scale" in tensors:
        return nvfp4_from_checkpoint(tensors, name, out_features, in_features)
    w = tensors[f"{name}.weight"]
    if tuple(w.shape) != (out_features, in_features):
        raise ValueError(f"checkpoint: {name + '.weight'!r} has shape {tuple(w.shape)}, expected "
                         f"{(out_features, in_features)}")
    return w


def attention_weights(tensors, cfg: V4Config, layer: int) -> dict:
    """Checkpoint tensors of ``layers.{layer}.attn.`` -> the mapping :meth:`Nvfp4Attention.load_weights` takes."""
    p = f"layers.{layer}.attn."
    H, D, dim = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    shapes = {"wq_a": (cfg.q_lora_rank, dim), "wq_b": (H * D, cfg.q_lora_rank), "wkv": (D, dim),
              "wo_a": (cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups),
              "wo_b": (dim, cfg.o_groups * cfg.o_lora_rank)}
    if cfg.layer_kind(layer) == "csa":
        shapes["indexer.wq_b"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
    w = {f"{n}.weight": linear_from_checkpoint(tensors, p + n, *s) for n, s in shapes.items()}
    for name in tensors.keys() if hasattr(tensors, "keys") else ():
        if name.startswith(p):
            rest = name[len(p):]
            base = rest.rsplit(".", 1)[0]
            if base not in shapes and not rest.endswith(("weight_scale", "weight_scale_2", "input_scale")):
                w.setdefault(rest, tensors[name])
    return w


def moe_weights(tensors, cfg: V4Config, layer: int, experts=None):
    """Checkpoint tensors of ``layers.{layer}.ffn.`` -> (gate (E, H), bias or None, tid2eid or None, w13 (n, 2I, H),
    w2 (n, H, I), shared_w13 (2Is, H), shared_w2 (H, Is)); official names w1 = gate, w3 = up, w2 = down.
    experts: the routed expert ids to read (default all E; an expert-parallel rank reads its own, n of them)."""
    m = cfg.moe
    p = f"layers.{layer}.ffn."
    h, i, e = m.hidden_size, m.intermediate_size, m.num_experts

    names = ("w1", "w3", "w2")  # official Expert: w1 = gate, w3 = up, w2 = down
    w13, w2, _, _ = read_experts(tensors, p, range(e) if experts is None else experts, h, i, names)
    shared_w13, shared_w2, _ = read_shared_expert(tensors, p, h, m.shared_intermediate_size, names)
    hashed = layer < cfg.num_hash_layers
    gate = tensors[p + "gate.weight"]
    bias = None if hashed else tensors[p + "gate.bias"].float()
    tid2eid = tensors[p + "gate.tid2eid"] if hashed else None
    return gate, bias, tid2eid, w13, w2, shared_w13, shared_w2


class V4DecoderLayer:
    """Attention + MoE with hyper-connections; buffers for ``max_batch`` decode rows / ``max_prefill_tokens``."""

    def __init__(self, cfg: V4Config, layer: int, *, max_batch: int, max_prefill_tokens: int, max_slots: int,
                 max_context: int, device="cpu", mode: str = "w4a16", ep_group=None):
        self.cfg, self.layer, self.device = cfg, layer, resolve_device(device)
        self.hashed = layer < cfg.num_hash_layers
        self.attn = Nvfp4Attention(cfg, layer, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                                   max_slots=max_slots, max_context=max_context, device=device)
        if ep_group is None:
            self.moe = Nvfp4MoE(cfg.moe, max_num_tokens=max(max_batch, max_prefill_tokens), device=device, mode=mode)
        else:  # expert parallel: this rank's routed experts, the step's tokens split over the ranks
            from ..distributed.ep_block import TokenSplitMoE

            self.moe = TokenSplitMoE(cfg.moe, max_num_tokens=max(max_batch, max_prefill_tokens), max_batch=max_batch,
                                     group=ep_group, device=device, mode=mode)
        self._loaded = False

    def load_weights(self, tensors) -> None:
        """tensors: a mapping with this layer's checkpoint tensors (official names, ``layers.{i}.`` prefix)."""
        cfg, dev, p = self.cfg, self.device, f"layers.{self.layer}."

        def fp32(name, shape):
            t = tensors[p + name]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"checkpoint: {p + name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            return t.to(device=dev, dtype=torch.float32).contiguous()

        hc, dim = cfg.hc_mult, cfg.hidden_size
        mix = (2 + hc) * hc
        for kind in ("attn", "ffn"):
            setattr(self, f"hc_{kind}_fn", fp32(f"hc_{kind}_fn", (mix, hc * dim)))
            setattr(self, f"hc_{kind}_base", fp32(f"hc_{kind}_base", (mix,)))
            setattr(self, f"hc_{kind}_scale", fp32(f"hc_{kind}_scale", (3,)))
        self.attn_norm = fp32("attn_norm.weight", (dim,))
        self.ffn_norm = fp32("ffn_norm.weight", (dim,))
        self.attn.load_weights({k: (v.to(dev) if isinstance(v, (torch.Tensor, NVFP4Tensor)) else v)
                                for k, v in attention_weights(tensors, cfg, self.layer).items()})
        gate, bias, tid2eid, w13, w2, sw13, sw2 = moe_weights(tensors, cfg, self.layer,
                                                              getattr(self.moe, "local_experts", None))
        extra = {"tid2eid": tid2eid.to(dev)} if self.hashed else {}
        self.moe.load_weights(gate.to(dev), None if bias is None else bias.to(dev), w13.to(dev), w2.to(dev),
                              sw13.to(dev), sw2.to(dev), **extra)
        self.moe.release_reference_weights()  # serving: the kernels' interleaved copies are all it reads
        self._loaded = True

    def hc_args(self, kind: str) -> dict:
        """The hc_pre of ``kind`` ("attn" / "ffn") with its RMSNorm, as keyword arguments of ``hc_ops.hc_post_pre``
        (a previous layer fuses this layer's first hc_pre into its last hc_post)."""
        cfg = self.cfg
        return dict(hc_fn=getattr(self, f"hc_{kind}_fn"), hc_scale=getattr(self, f"hc_{kind}_scale"),
                    hc_base=getattr(self, f"hc_{kind}_base"), iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                    norm_eps=cfg.norm_eps, norm_weight=getattr(self, f"{kind}_norm"))

    def _hc(self, kind: str, h: torch.Tensor):
        """hc_pre of ``kind`` fused with its RMSNorm (``attn_norm`` / ``ffn_norm``): -> (normed x, post, comb)."""
        a = self.hc_args(kind)
        return hc_ops.hc_pre(h, a["hc_fn"], a["hc_scale"], a["hc_base"], hc=self.cfg.hc_mult, iters=a["iters"],
                             hc_eps=a["hc_eps"], norm_eps=a["norm_eps"], norm_weight=a["norm_weight"])

    def forward(self, h: torch.Tensor, attend, token_ids: torch.Tensor, timer=None) -> torch.Tensor:
        """h (T, hc, dim) bf16; attend(x (T, dim)) -> (T, dim) runs the attention block (decode or prefill);
        token_ids (T,) int64 (hash routing). ``timer`` (optional) marks "attention" / "moe" phases."""
        return self.forward_fused(h, None, attend, token_ids, None, timer)[0]

    def forward_fused(self, h: torch.Tensor, pre, attend, token_ids: torch.Tensor, next_hc: dict | None,
                      timer=None):
        """:meth:`forward` with the hyper-connections chained across layers: ``pre`` is this layer's attn hc_pre
        result (x, post, comb) when the previous layer computed it (None: computed here from ``h``); ``next_hc``
        (``hc_args`` of the next layer's "attn", or the head's hc with ``head=True``; None: none) is fused into this
        layer's last hc_post. -> (h, the next hc_pre's (x, post, comb) or None). Same bits as the unfused chain."""
        x, post, comb = self._hc("attn", h) if pre is None else pre
        if timer is not None:
            timer("other")
        x = attend(x)
        if timer is not None:
            timer("attention")
        h, x, post, comb = hc_ops.hc_post_pre(x, h, post, comb, **self.hc_args("ffn"))
        if timer is not None:
            timer("other")
        y = self.moe.forward(x, token_ids=token_ids) if self.hashed else self.moe.forward(x)
        if timer is not None:
            timer("moe")
        if next_hc is None:
            return hc_ops.hc_post(y, h, post, comb), None
        h, x, post, comb = hc_ops.hc_post_pre(y, h, post, comb, **next_hc)
        return h, (x, post, comb)
