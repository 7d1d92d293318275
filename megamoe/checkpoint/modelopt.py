"""ModelOpt NVFP4 safetensors: load a DeepSeek MoE block, and build such tensors from bf16.

Tensor names, relative to a ``prefix`` such as ``"model.layers.3.mlp."``:

* ``gate.weight`` (E, H) bf16/fp32 and ``gate.e_score_correction_bias`` (E,) fp32
  (required when the config uses the correction bias);
* per routed expert ``e`` and projection ``p`` in gate_proj/up_proj/down_proj:
  ``experts.{e}.{p}.weight`` uint8 (N, K//2) (low nibble = even element),
  ``.weight_scale`` float8_e4m3fn (N, K//16), ``.weight_scale_2`` fp32 scalar
  (global scale: value = e2m1 * weight_scale * weight_scale_2), and optionally
  ``.input_scale`` fp32 scalar (static activation global scale, w4a4);
* the shared expert: ``shared_experts.{p}.*`` with the same four tensors;
* hash-routed layers (DeepSeek-V4's first ``num_hash_layers``): ``gate.tid2eid``
  (vocab, k) int32/int64 instead of the correction bias (entries in [0, E)).

``source`` may be a dict, a :class:`~megamoe.checkpoint.sharded.ShardedCheckpoint`, or a path: a
``.safetensors`` file or a (sharded) checkpoint directory, read lazily (only this block's tensors).
Every NVFP4 linear is checked with :func:`~megamoe.checkpoint.sharded.check_tensor` (shapes, dtypes, and
``weight_scale_2`` / ``input_scale`` finite and > 0).

Loading stacks the experts into ``w13`` (E, 2I, H) = [gate; up] and ``w2``
(E, H, I). Gate and up keep their own ``weight_scale_2`` exactly: when they
differ the stacked tensor gets a per-row global scale (E, 2I, 1). ``input_scale``
(when present on every projection) becomes the layer's static w4a4 scales:
L1 = max over experts' gate/up input scales (one tensor feeds all experts),
L2 = each expert's down_proj input scale.
"""
from __future__ import annotations

import os

import torch

from ..format.tensor import NVFP4Tensor
from ..layers.moe import Nvfp4MoE, quantize_weight
from ..models.config import MoEConfig
from .sharded import CheckpointError, ShardedCheckpoint, check_tensor

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _get(tensors, name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint: missing tensor {name!r}")
    return tensors[name]


def _optional(tensors, name: str):
    return tensors[name] if name in tensors else None


def _expect(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple) -> torch.Tensor:
    if t.dtype not in dtypes:
        raise CheckpointError(f"checkpoint: {name!r} has dtype {t.dtype}, expected one of {dtypes}")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"checkpoint: {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def read_nvfp4_linear(tensors, name: str, out_features: int, in_features: int):
    """One ModelOpt NVFP4 linear ``name`` (without ``.weight``) -> (NVFP4Tensor (N, K), input_scale or None).

    tensors: a dict or a ShardedCheckpoint. Checked with ``check_tensor(..., "nvfp4")``.
    """
    parts = {"weight": _get(tensors, f"{name}.weight"), "weight_scale": _get(tensors, f"{name}.weight_scale"),
             "weight_scale_2": _get(tensors, f"{name}.weight_scale_2")}
    input_scale = _optional(tensors, f"{name}.input_scale")
    if input_scale is not None:
        parts["input_scale"] = input_scale
    p = check_tensor(name, parts, (out_features, in_features), "nvfp4")
    weight = NVFP4Tensor(p["weight"], p["weight_scale"], p["weight_scale_2"], (out_features, in_features))
    return weight, p["input_scale"]


def _stack_gate_up(gate: NVFP4Tensor, up: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = gate.shape[0]
    rows_gs = torch.cat((gate.global_scale.expand(n), up.global_scale.expand(n))).reshape(2 * n, 1)
    return torch.cat((gate.data, up.data)), torch.cat((gate.block_scale, up.block_scale)), rows_gs


def _load_ffn(tensors: dict, prefix: str, hidden: int, inter: int, names: tuple = PROJECTIONS):
    """gate/up/down of one FFN -> (w13 parts, w2, l1 input scale, l2 input scale). ``names``: the gate, up and down
    projections' names (HF / ModelOpt ``gate_proj, up_proj, down_proj``; official DeepSeek ``w1, w3, w2``)."""
    gate_name, up_name, down_name = names
    gate, gate_in = read_nvfp4_linear(tensors, f"{prefix}{gate_name}", inter, hidden)
    up, up_in = read_nvfp4_linear(tensors, f"{prefix}{up_name}", inter, hidden)
    down, down_in = read_nvfp4_linear(tensors, f"{prefix}{down_name}", hidden, inter)
    l1 = None if gate_in is None or up_in is None else torch.maximum(gate_in, up_in)
    return _stack_gate_up(gate, up), down, l1, down_in


def read_experts(tensors, prefix: str, experts, hidden: int, inter: int, names: tuple = PROJECTIONS):
    """Routed experts ``experts`` (an iterable of ids) of ``{prefix}experts.{e}.`` stacked -> (w13 (n, 2I, H)
    [gate; up], w2 (n, H, I), l1 input scales, l2 input scales: lists with None where absent)."""
    data13, scale13, gs13, data2, scale2, gs2, l1s, l2s = [], [], [], [], [], [], [], []
    for expert in experts:
        (d, s, g), down, l1, l2 = _load_ffn(tensors, f"{prefix}experts.{expert}.", hidden, inter, names)
        data13.append(d), scale13.append(s), gs13.append(g)
        data2.append(down.data), scale2.append(down.block_scale), gs2.append(down.global_scale.reshape(1, 1))
        l1s.append(l1), l2s.append(l2)
    n = len(data13)
    w13 = NVFP4Tensor(torch.stack(data13), torch.stack(scale13), _compact_global_scale(torch.stack(gs13)),
                      (n, 2 * inter, hidden))
    w2 = NVFP4Tensor(torch.stack(data2), torch.stack(scale2), torch.stack(gs2), (n, hidden, inter))
    return w13, w2, l1s, l2s


def read_shared_expert(tensors, prefix: str, hidden: int, inter: int, names: tuple = PROJECTIONS):
    """The shared expert ``{prefix}shared_experts.`` -> (w13 (2I, H), w2 (H, I), (l1, l2) input scales or None)."""
    (d, s, g), w2, l1, l2 = _load_ffn(tensors, f"{prefix}shared_experts.", hidden, inter, names)
    g = _compact_global_scale(g)
    w13 = NVFP4Tensor(d, s, g.reshape(()) if g.numel() == 1 else g, (2 * inter, hidden))
    return w13, w2, (l1, l2)


def read_router(tensors, prefix: str, config: MoEConfig):
    """``{prefix}gate.*`` -> (gate weight (E, H) bf16/fp32, correction bias (E,) float32 or None, hash table
    (vocab, k) int32/int64 or None). A hash-routed layer (a ``gate.tid2eid`` table: DeepSeek-V4's first layers)
    has no correction bias."""
    c = config
    gate_weight = _expect(_get(tensors, f"{prefix}gate.weight"), f"{prefix}gate.weight",
                          (c.num_experts, c.hidden_size), (torch.bfloat16, torch.float32))
    bias = None
    tid2eid = _optional(tensors, f"{prefix}gate.tid2eid")
    if tid2eid is not None:
        name = f"{prefix}gate.tid2eid"
        if tid2eid.dtype not in (torch.int32, torch.int64) or tid2eid.dim() != 2 or tid2eid.shape[1] != c.top_k:
            raise CheckpointError(f"checkpoint: {name!r} has shape {tuple(tid2eid.shape)} {tid2eid.dtype}, "
                                  f"expected (vocab, {c.top_k}) int32/int64")
    elif c.use_correction_bias:
        name = f"{prefix}gate.e_score_correction_bias"
        bias = _expect(_get(tensors, name), name, (c.num_experts,), (torch.float32, torch.bfloat16)).float()
    return gate_weight, bias, tid2eid


def open_tensors(source):
    """A path (a ``.safetensors`` file or a checkpoint directory, read lazily), a ShardedCheckpoint or a dict ->
    the mapping the loaders read tensors from."""
    if isinstance(source, (str, os.PathLike)):
        return ShardedCheckpoint(source)
    if isinstance(source, (dict, ShardedCheckpoint)):
        return source
    raise TypeError(f"source: expected a path, a ShardedCheckpoint or a dict of tensors, got {type(source).__name__}")


def _compact_global_scale(rows_gs: torch.Tensor) -> torch.Tensor:
    """(..., 2I, 1) per-row scale -> (..., 1, 1) when all rows of each leading index agree (load time only)."""
    first = rows_gs[..., :1, :]
    return first if torch.equal(rows_gs, first.expand_as(rows_gs)) else rows_gs


def load_moe_layer(source, config: MoEConfig, *, prefix: str = "", max_num_tokens: int, device="cpu",
                   mode: str = "w4a16") -> Nvfp4MoE:
    """Build an :class:`Nvfp4MoE` from ModelOpt NVFP4 tensors.

    source: a dict name -> tensor, a ShardedCheckpoint, or a path (a ``.safetensors`` file or a checkpoint
    directory, read lazily). prefix: prepended to every tensor name (e.g. ``"model.layers.3.mlp."``).
    Raises :class:`CheckpointError` (a ValueError) naming the missing or
    mis-shaped tensor. Static w4a4 scales are installed when every projection
    has an ``input_scale``.
    """
    tensors = open_tensors(source)
    c = config
    h, i, e = c.hidden_size, c.intermediate_size, c.num_experts
    gate_weight, bias, tid2eid = read_router(tensors, prefix, c)
    w13, w2, l1s, l2s = read_experts(tensors, prefix, range(e), h, i)
    shared_w13 = shared_w2 = None
    shared_scales = (None, None)
    if c.shared_intermediate_size:
        shared_w13, shared_w2, shared_scales = read_shared_expert(tensors, prefix, h, c.shared_intermediate_size)
    dev = torch.device(device)
    layer = Nvfp4MoE(c, max_num_tokens=max_num_tokens, device=dev, mode=mode)
    try:
        layer.load_weights(gate_weight.to(dev), None if bias is None else bias.to(dev), w13.to(dev), w2.to(dev),
                           None if shared_w13 is None else shared_w13.to(dev),
                           None if shared_w2 is None else shared_w2.to(dev),
                           tid2eid=None if tid2eid is None else tid2eid.to(dev))
    except ValueError as error:
        if tid2eid is not None and "tid2eid" in str(error):
            raise CheckpointError(f"checkpoint: {prefix}gate.tid2eid: {error}") from error
        raise
    if all(s is not None for s in l1s + l2s):
        layer.set_input_scales(torch.stack(l1s).amax(), torch.stack(l2s), *shared_scales)
    return layer


def quantize_model_weights(state_dict: dict, *, input_scales: dict | None = None) -> dict:
    """bf16/fp32 state dict -> ModelOpt-style NVFP4 tensors for every ``*_proj.weight`` of an FFN.

    Every 2-D tensor whose name ends in ``gate_proj.weight``, ``up_proj.weight`` or
    ``down_proj.weight`` (K a multiple of 16) becomes ``weight`` uint8 (N, K//2),
    ``weight_scale`` float8_e4m3fn (N, K//16) and ``weight_scale_2`` fp32 scalar
    (amax / 2688, the reference quantizer). Other tensors pass through.
    input_scales: optional ``{module name: fp32 scalar}`` written as ``input_scale``.
    """
    out = {}
    for name, t in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS and t.dim() == 2:
            q = quantize_weight(t)
            out[f"{module}.weight"] = q.data.contiguous()
            out[f"{module}.weight_scale"] = q.block_scale.contiguous()
            out[f"{module}.weight_scale_2"] = q.global_scale.reshape(()).float().contiguous()
            if input_scales and module in input_scales:
                out[f"{module}.input_scale"] = torch.as_tensor(input_scales[module], dtype=torch.float32).reshape(())
        else:
            out[name] = t
    return out


def bf16_moe_state_dict(weights: dict, config: MoEConfig, prefix: str = "") -> dict:
    """Per-expert HF-style bf16 state dict from stacked weights (as returned by
    ``Nvfp4MoE.random(return_bf16=True)``)."""
    c, sd = config, {}
    i = c.intermediate_size
    sd[f"{prefix}gate.weight"] = weights["gate_weight"]
    if weights.get("correction_bias") is not None:
        sd[f"{prefix}gate.e_score_correction_bias"] = weights["correction_bias"].float()
    for e in range(c.num_experts):
        sd[f"{prefix}experts.{e}.gate_proj.weight"] = weights["w13"][e, :i].contiguous()
        sd[f"{prefix}experts.{e}.up_proj.weight"] = weights["w13"][e, i:].contiguous()
        sd[f"{prefix}experts.{e}.down_proj.weight"] = weights["w2"][e].contiguous()
    if weights.get("shared_w13") is not None:
        si = c.shared_intermediate_size
        sd[f"{prefix}shared_experts.gate_proj.weight"] = weights["shared_w13"][:si].contiguous()
        sd[f"{prefix}shared_experts.up_proj.weight"] = weights["shared_w13"][si:].contiguous()
        sd[f"{prefix}shared_experts.down_proj.weight"] = weights["shared_w2"].contiguous()
    return sd
