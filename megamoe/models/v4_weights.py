"""DeepSeek-V4 weights: names, shapes and storage kinds (the single source of truth), random checkpoints, decoding.

Names are those of the official DeepSeek-V4 checkpoint, i.e. the module paths of the official
``inference/model.py`` (``Transformer`` -> ``layers.{i}`` ``Block`` -> ``attn`` / ``ffn`` ...). Shapes follow its
module definitions with this package's :class:`~megamoe.models.config.V4Config`:

========================================  ===========================================  ========
name (per layer: prefix ``layers.{i}.``)   shape                                        kind
========================================  ===========================================  ========
``embed.weight`` / ``head.weight``         (vocab, dim)                                 bf16
``norm.weight``                            (dim,)                                       bf16
``hc_head_fn`` / ``_base`` / ``_scale``    (hc, hc*dim) / (hc,) / (1,)                  fp32
``attn_norm.weight``, ``ffn_norm.weight``  (dim,)                                       bf16
``hc_{attn,ffn}_fn``                       ((2+hc)*hc, hc*dim)                          fp32
``hc_{attn,ffn}_base`` / ``_scale``        ((2+hc)*hc,) / (3,)                          fp32
``attn.attn_sink``                         (n_heads,)                                   fp32
``attn.wq_a.weight``                       (q_lora_rank, dim)                           nvfp4
``attn.q_norm.weight``                     (q_lora_rank,)                               bf16
``attn.wq_b.weight``                       (n_heads*head_dim, q_lora_rank)              nvfp4
``attn.wkv.weight``                        (head_dim, dim)                              nvfp4
``attn.kv_norm.weight``                    (head_dim,)                                  bf16
``attn.wo_a.weight``                       (o_groups*o_lora_rank, n_heads*head_dim/G)   nvfp4
``attn.wo_b.weight``                       (dim, o_groups*o_lora_rank)                  nvfp4
``attn.compressor.ape`` (ratio > 0)        (ratio, coff*head_dim), coff = 2 if ratio 4  fp32
``attn.compressor.{wkv,wgate}.weight``     (coff*head_dim, dim)                         bf16
``attn.compressor.norm.weight``            (head_dim,)                                  bf16
``attn.indexer.wq_b.weight`` (ratio 4)     (index_n_heads*index_head_dim, q_lora_rank)  nvfp4
``attn.indexer.weights_proj.weight``       (index_n_heads, dim)                         bf16
``attn.indexer.compressor.ape``            (4, 2*index_head_dim)                        fp32
``attn.indexer.compressor.{wkv,wgate}``    (2*index_head_dim, dim) (``.weight``)         bf16
``attn.indexer.compressor.norm.weight``    (index_head_dim,)                            bf16
``ffn.gate.weight``                        (n_experts, dim)                             bf16
``ffn.gate.bias`` (score-routed layers)    (n_experts,)                                 fp32
``ffn.gate.tid2eid`` (hash layers)         (vocab, top_k)                               int32
``ffn.experts.{e}.{w1,w3}.weight``         (moe_inter, dim)                             nvfp4
``ffn.experts.{e}.w2.weight``              (dim, moe_inter)                             nvfp4
``ffn.shared_experts.{w1,w3}.weight``      (shared_inter, dim)                          nvfp4
``ffn.shared_experts.w2.weight``           (dim, shared_inter)                          nvfp4
========================================  ===========================================  ========

(``w1`` = gate projection, ``w3`` = up projection, ``w2`` = down projection: official ``Expert``.) Hash layers are
the first ``num_hash_layers``; their gate has no bias (official ``Gate``). The multi-token-prediction blocks
``mtp.{j}.*`` are not listed (not run by this package).

Storage kinds (this package's NVIDIA-ModelOpt NVFP4 convention, how a checkpoint holds each logical weight):

=========  =============================================================================================
kind       stored tensors
=========  =============================================================================================
``nvfp4``  ``X.weight`` uint8 (out, in/2): packed E2M1 codes, the low nibble holds the even element;
           ``X.weight_scale`` float8_e4m3fn (out, in/16): one scale per 16 elements along ``in``;
           ``X.weight_scale_2`` float32 0-d: the global scale (value = e2m1 * weight_scale * weight_scale_2);
           optional ``X.input_scale`` float32 0-d (static activation scale; not written by
           :func:`random_state_dict`). Decoding is exact (:func:`megamoe.reference.quantize.dequantize`).
``bf16``   ``X`` bfloat16 of the listed shape (norm weights, embeddings, head, compressor projections, indexer
           ``weights_proj``, router ``gate.weight``)
``fp32``   ``X`` float32 (``ape``, ``attn_sink``, ``hc_*``, ``gate.bias``)
``int32``  ``X`` int32 (``tid2eid``)
=========  =============================================================================================
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

from ..format.constants import BLOCK_SIZE
from ..format.tensor import NVFP4Tensor
from ..reference.quantize import dequantize, quantize
from .config import CSA_RATIO, V4Config

KINDS = ("nvfp4", "bf16", "fp32", "int32")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}
NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@dataclass(frozen=True)
class WeightSpec:
    """One logical weight: official ``name``, logical ``shape`` ((out, in) for linears), storage ``kind``."""

    name: str
    shape: tuple
    kind: str

    def stored(self) -> dict:
        """The checkpoint tensors of this weight: ``{tensor name: (shape, dtype)}`` (``input_scale`` omitted)."""
        if self.kind != "nvfp4":
            return {self.name: (self.shape, _DTYPES[self.kind])}
        out_features, in_features = self.shape
        base = self.name[: -len("weight")]
        return {
            base + "weight": ((out_features, in_features // 2), torch.uint8),
            base + "weight_scale": ((out_features, in_features // BLOCK_SIZE), torch.float8_e4m3fn),
            base + "weight_scale_2": ((), torch.float32),
        }


def _layer_specs(cfg: V4Config, i: int) -> list:
    d, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc
    h, hd, ql = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, r = cfg.o_groups, cfg.o_lora_rank
    ratio = cfg.compress_ratios[i]
    p = f"layers.{i}."
    s = [
        WeightSpec(p + "attn_norm.weight", (d,), "bf16"),
        WeightSpec(p + "ffn_norm.weight", (d,), "bf16"),
    ]
    for part in ("attn", "ffn"):
        s += [WeightSpec(f"{p}hc_{part}_fn", (mix, hc * d), "fp32"),
              WeightSpec(f"{p}hc_{part}_base", (mix,), "fp32"),
              WeightSpec(f"{p}hc_{part}_scale", (3,), "fp32")]
    a = p + "attn."
    s += [
        WeightSpec(a + "attn_sink", (h,), "fp32"),
        WeightSpec(a + "wq_a.weight", (ql, d), "nvfp4"),
        WeightSpec(a + "q_norm.weight", (ql,), "bf16"),
        WeightSpec(a + "wq_b.weight", (h * hd, ql), "nvfp4"),
        WeightSpec(a + "wkv.weight", (hd, d), "nvfp4"),
        WeightSpec(a + "kv_norm.weight", (hd,), "bf16"),
        WeightSpec(a + "wo_a.weight", (g * r, h * hd // g), "nvfp4"),
        WeightSpec(a + "wo_b.weight", (d, g * r), "nvfp4"),
    ]

    def compressor(prefix: str, width: int) -> list:
        coff = 2 if ratio == CSA_RATIO else 1
        return [WeightSpec(prefix + "ape", (ratio, coff * width), "fp32"),
                WeightSpec(prefix + "wkv.weight", (coff * width, d), "bf16"),
                WeightSpec(prefix + "wgate.weight", (coff * width, d), "bf16"),
                WeightSpec(prefix + "norm.weight", (width,), "bf16")]

    if ratio:
        s += compressor(a + "compressor.", hd)
    if ratio == CSA_RATIO:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        s += [WeightSpec(a + "indexer.wq_b.weight", (ih * idim, ql), "nvfp4"),
              WeightSpec(a + "indexer.weights_proj.weight", (ih, d), "bf16")]
        s += compressor(a + "indexer.compressor.", idim)
    m = cfg.moe
    f = p + "ffn."
    s.append(WeightSpec(f + "gate.weight", (m.num_experts, d), "bf16"))
    if i < cfg.num_hash_layers:
        s.append(WeightSpec(f + "gate.tid2eid", (cfg.vocab_size, m.top_k), "int32"))
    else:
        s.append(WeightSpec(f + "gate.bias", (m.num_experts,), "fp32"))

    def expert(prefix: str, inter: int) -> list:
        return [WeightSpec(prefix + "w1.weight", (inter, d), "nvfp4"),
                WeightSpec(prefix + "w2.weight", (d, inter), "nvfp4"),
                WeightSpec(prefix + "w3.weight", (inter, d), "nvfp4")]

    for e in range(m.num_experts):
        s += expert(f"{f}experts.{e}.", m.intermediate_size)
    if m.shared_intermediate_size:
        s += expert(f + "shared_experts.", m.shared_intermediate_size)
    return s


def weight_specs(cfg: V4Config, layers: Iterable[int] | None = None) -> dict:
    """Every logical weight of the model (or of the top level plus ``layers``): ``{name: WeightSpec}``."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    specs = [
        WeightSpec("embed.weight", (cfg.vocab_size, d), "bf16"),
        WeightSpec("norm.weight", (d,), "bf16"),
        WeightSpec("head.weight", (cfg.vocab_size, d), "bf16"),
        WeightSpec("hc_head_fn", (hc, hc * d), "fp32"),
        WeightSpec("hc_head_base", (hc,), "fp32"),
        WeightSpec("hc_head_scale", (1,), "fp32"),
    ]
    for i in (range(cfg.num_layers) if layers is None else layers):
        if not 0 <= i < cfg.num_layers:
            raise ValueError(f"layers: index {i} outside 0..{cfg.num_layers - 1}")
        specs += _layer_specs(cfg, i)
    return {s.name: s for s in specs}


# ----------------------------------------------------------------------------------------------
# random checkpoints
# ----------------------------------------------------------------------------------------------
def _generator(seed: int, name: str, device) -> torch.Generator:
    """One generator per tensor, so a tensor's values do not depend on which other tensors are generated."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 62))
    return g


def _random_values(spec: WeightSpec, g: torch.Generator, device) -> torch.Tensor:
    """float32 values of a realistic scale for one weight (see :func:`random_state_dict`)."""
    name = spec.name.rsplit(".", 1)[0] if spec.name.endswith(".weight") else spec.name
    leaf = name.rsplit(".", 1)[-1]

    def randn(std: float) -> torch.Tensor:
        return torch.randn(spec.shape, generator=g, device=device) * std

    if spec.kind == "nvfp4" or leaf in ("wkv", "wgate", "weights_proj", "gate", "head"):
        return randn(spec.shape[1] ** -0.5)
    if leaf.endswith("norm"):
        return 1.0 + randn(0.1)
    if leaf == "embed":
        return randn(1.0)
    if leaf == "attn_sink":
        return randn(1.0)
    if leaf == "ape":
        return randn(0.1)
    if leaf == "bias":
        return randn(0.05)
    if leaf.endswith("_fn"):
        return randn(1e-2)
    if leaf.endswith("_base"):
        return randn(0.5)
    if leaf.endswith("_scale"):
        return 1.0 + randn(0.1)
    raise AssertionError(f"no random rule for {spec.name}")


def random_state_dict(cfg: V4Config, *, seed: int = 0, device="cpu", layers: Iterable[int] | None = None,
                      select: Callable[[str], bool] | None = None) -> dict:
    """A random checkpoint in the storage format of the module docstring: ``{tensor name: tensor}``.

    Scales: linears ``N(0, in**-0.5)`` (NVFP4 ones quantized by :func:`megamoe.reference.quantize.quantize` with
    one global scale per tensor, one expert at a time), norm weights ``1 + N(0, 0.1)``, ``embed`` N(0, 1),
    ``attn_sink`` N(0, 1), ``ape`` N(0, 0.1), ``hc_*_fn`` N(0, 1e-2) (Sinkhorn mixes not saturated), ``hc_*_base``
    N(0, 0.5), ``hc_*_scale`` ``1 + N(0, 0.1)``, ``gate.bias`` N(0, 0.05), ``tid2eid`` rows of distinct random
    experts. Every tensor has its own generator seeded from ``(seed, name)``, so ``layers`` (a subset of layer
    indices; the top-level tensors are always included) and ``select`` (keep the logical weights whose name it
    accepts, e.g. ``lambda n: ".attn." in n``) change which tensors exist, never their values.
    """
    device = torch.device(device)
    out = {}
    for spec in weight_specs(cfg, layers).values():
        if select is not None and not select(spec.name):
            continue
        g = _generator(seed, spec.name, device)
        if spec.kind == "int32":
            vocab, k = spec.shape
            keys = torch.rand((vocab, cfg.moe.num_experts), generator=g, device=device)
            out[spec.name] = keys.topk(k, dim=-1).indices.to(torch.int32)
            continue
        values = _random_values(spec, g, device)
        if spec.kind == "nvfp4":
            t = quantize(values)
            base = spec.name[: -len("weight")]
            out[base + "weight"] = t.data
            out[base + "weight_scale"] = t.block_scale
            out[base + "weight_scale_2"] = t.global_scale.reshape(())
        else:
            out[spec.name] = values.to(_DTYPES[spec.kind])
    return out


# ----------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------
def _linear_base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def is_nvfp4(tensors: Mapping, name: str) -> bool:
    """Whether ``name`` (``X`` or ``X.weight``) is stored as an NVFP4 linear in ``tensors``."""
    return _linear_base(name) + ".weight_scale" in tensors


def nvfp4_weight(tensors: Mapping, name: str) -> NVFP4Tensor:
    """The :class:`NVFP4Tensor` (out, in) of the NVFP4 linear ``name`` (``X`` or ``X.weight``)."""
    base = _linear_base(name)
    if base + ".weight_scale" not in tensors:
        raise KeyError(f"{base}: not an NVFP4 linear here (no {base}.weight_scale)")
    data = tensors[base + ".weight"]
    scale = tensors[base + ".weight_scale"]
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    gs = tensors[base + ".weight_scale_2"].float().reshape(())
    return NVFP4Tensor(data, scale, gs, (data.shape[0], data.shape[1] * 2))


def decoded_weight(tensors: Mapping, name: str) -> torch.Tensor:
    """One logical weight as float32 (NVFP4 linears decoded exactly to (out, in)); int32 tensors as stored."""
    if is_nvfp4(tensors, name):
        return dequantize(nvfp4_weight(tensors, name), torch.float32)
    t = tensors[name]
    return t if not t.is_floating_point() else t.float()


def decoded_state_dict(tensors: Mapping, names: Iterable[str] | None = None) -> dict:
    """``{logical name: decoded tensor}`` for ``names`` (default: every logical weight present in ``tensors``).

    NVFP4 linears appear once, as ``X.weight`` (float32 (out, in)); their scale tensors are dropped.
    """
    if names is None:
        names = [n for n in tensors
                 if not n.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))]
    return {n: decoded_weight(tensors, n) for n in names}


class DecodedView(Mapping):
    """Read-only ``{logical name: decoded tensor}`` view of checkpoint tensors that decodes on every access (no
    float32 copy of the whole model; use :func:`decoded_state_dict` to decode once when it fits)."""

    def __init__(self, tensors: Mapping):
        self.tensors = tensors
        self._names = [n for n in tensors if not n.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(name)
        return decoded_weight(self.tensors, name)

    def __contains__(self, name) -> bool:
        return name in self.tensors and not str(name).endswith((".weight_scale", ".weight_scale_2", ".input_scale"))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def check_state_dict(cfg: V4Config, tensors: Mapping, layers: Iterable[int] | None = None) -> None:
    """Raise ValueError listing every missing or mis-shaped / mis-typed stored tensor of ``cfg`` (or ``layers``)."""
    problems = []
    for spec in weight_specs(cfg, layers).values():
        for name, (shape, dtype) in spec.stored().items():
            t = tensors.get(name)
            if t is None:
                problems.append(f"{name}: missing")
                continue
            ok_dtype = t.dtype == dtype or (dtype == torch.float8_e4m3fn and t.dtype == torch.uint8)
            if tuple(t.shape) != tuple(shape) and not (shape == () and t.numel() == 1):
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
            if not ok_dtype:
                problems.append(f"{name}: dtype {t.dtype}, expected {dtype}")
    if problems:
        head = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise ValueError(f"state dict does not match {cfg.name}: {head}{more}")
