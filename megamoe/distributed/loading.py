"""Expert-parallel loading from a ModelOpt NVFP4 checkpoint: each rank reads only its own experts' tensors.

Tensor names and checks are those of :func:`megamoe.checkpoint.load_moe_layer` (``gate.weight``,
``gate.e_score_correction_bias`` or ``gate.tid2eid``, ``experts.{e}.{gate,up,down}_proj.*``,
``shared_experts.*``). With a path or a :class:`~megamoe.checkpoint.ShardedCheckpoint`, the reader opens a
shard only when one of the requested tensors lives in it, so rank r touches the replicated tensors and the
tensors of experts ``[r*E/W, (r+1)*E/W)`` only.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..checkpoint.modelopt import _compact_global_scale, _expect, _get, _load_ffn, _optional
from ..checkpoint.sharded import CheckpointError, ShardedCheckpoint
from ..format.tensor import NVFP4Tensor
from ..models.config import MoEConfig
from .ep_moe import ExpertParallelMoE


def load_expert_parallel_moe(source, config: MoEConfig, *, prefix: str = "", max_num_tokens: int, group=None,
                             device="cpu", mode: str = "w4a16", **kwargs) -> ExpertParallelMoE:
    """Build this rank's :class:`ExpertParallelMoE` from ModelOpt NVFP4 tensors (a collective).

    source: a path (``.safetensors`` file or checkpoint directory, read lazily), a ShardedCheckpoint or a
    dict. kwargs: passed to :class:`ExpertParallelMoE` (capacity_tokens, fuse settings, backends).
    Static w4a4 scales are installed when every projection has an ``input_scale`` (L1 = the max over all
    experts' gate/up input scales, as the single-process loader; reduced across the ranks).
    """
    if isinstance(source, (str, os.PathLike)):
        tensors = ShardedCheckpoint(source)
    elif isinstance(source, (dict, ShardedCheckpoint)):
        tensors = source
    else:
        raise TypeError(f"source: expected a path, a ShardedCheckpoint or a dict of tensors, got "
                        f"{type(source).__name__}")
    layer = ExpertParallelMoE(config, max_num_tokens=max_num_tokens, group=group, device=device, mode=mode,
                              **kwargs)
    c, dev = config, layer.device
    h, i, e = c.hidden_size, c.intermediate_size, c.num_experts
    gate_weight = _expect(_get(tensors, f"{prefix}gate.weight"), f"{prefix}gate.weight", (e, h),
                          (torch.bfloat16, torch.float32))
    bias = None
    tid2eid = _optional(tensors, f"{prefix}gate.tid2eid")
    if tid2eid is not None:
        name = f"{prefix}gate.tid2eid"
        if tid2eid.dtype not in (torch.int32, torch.int64) or tid2eid.dim() != 2 or tid2eid.shape[1] != c.top_k:
            raise CheckpointError(f"checkpoint: {name!r} has shape {tuple(tid2eid.shape)} {tid2eid.dtype}, "
                                  f"expected (vocab, {c.top_k}) int32/int64")
    elif c.use_correction_bias:
        name = f"{prefix}gate.e_score_correction_bias"
        bias = _expect(_get(tensors, name), name, (e,), (torch.float32, torch.bfloat16)).float()
    data13, scale13, gs13, data2, scale2, gs2, l2s = [], [], [], [], [], [], []
    l1_local = []
    for expert in range(layer.expert_start, layer.expert_stop):
        (d, s, g), down, l1, l2 = _load_ffn(tensors, f"{prefix}experts.{expert}.", h, i)
        data13.append(d), scale13.append(s), gs13.append(g)
        data2.append(down.data), scale2.append(down.block_scale), gs2.append(down.global_scale.reshape(1, 1))
        l1_local.append(l1), l2s.append(l2)
    el = layer.num_local_experts
    w13 = NVFP4Tensor(torch.stack(data13), torch.stack(scale13), _compact_global_scale(torch.stack(gs13)),
                      (el, 2 * i, h))
    w2 = NVFP4Tensor(torch.stack(data2), torch.stack(scale2), torch.stack(gs2), (el, h, i))
    shared_w13 = shared_w2 = None
    shared_scales = (None, None)
    if c.shared_intermediate_size:
        si = c.shared_intermediate_size
        (d, s, g), shared_w2, sl1, sl2 = _load_ffn(tensors, f"{prefix}shared_experts.", h, si)
        shared_w13 = NVFP4Tensor(d, s, _compact_global_scale(g), (2 * si, h))
        if shared_w13.global_scale.numel() == 1:
            shared_w13 = NVFP4Tensor(d, s, shared_w13.global_scale.reshape(()), (2 * si, h))
        shared_scales = (sl1, sl2)
    layer.load_weights(gate_weight.to(dev), None if bias is None else bias.to(dev), w13.to(dev), w2.to(dev),
                       None if shared_w13 is None else shared_w13.to(dev),
                       None if shared_w2 is None else shared_w2.to(dev),
                       tid2eid=None if tid2eid is None else tid2eid.to(dev))
    # Static w4a4 scales when every projection has an input_scale (on every rank: a MIN all-reduce of the
    # flag). L1 is one scale for all experts: the max over the ranks' local maxima (a MAX all-reduce, exact),
    # so no rank reads another rank's expert tensors.
    have = torch.tensor([int(all(s is not None for s in l1_local + l2s))], dtype=torch.int32, device=dev)
    dist.all_reduce(have, op=dist.ReduceOp.MIN, group=layer.group)
    if int(have.item()):
        l1 = torch.stack(l1_local).amax().to(dev).reshape(1).float()
        dist.all_reduce(l1, op=dist.ReduceOp.MAX, group=layer.group)
        layer.set_input_scales(l1.reshape(()), torch.stack(l2s), *shared_scales)
    return layer
