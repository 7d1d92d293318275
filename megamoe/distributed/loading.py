"""Expert-parallel loading from a ModelOpt NVFP4 checkpoint: each rank reads only its own experts' tensors.

Tensor names and checks are those of :func:`megamoe.checkpoint.load_moe_layer` (``gate.weight``,
``gate.e_score_correction_bias`` or ``gate.tid2eid``, ``experts.{e}.{gate,up,down}_proj.*``,
``shared_experts.*``). With a path or a :class:`~megamoe.checkpoint.ShardedCheckpoint`, the reader opens a
shard only when one of the requested tensors lives in it, so rank r touches the replicated tensors and the
tensors of experts ``[r*E/W, (r+1)*E/W)`` only.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from ..checkpoint.modelopt import open_tensors, read_experts, read_router, read_shared_expert
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
    tensors = open_tensors(source)
    layer = ExpertParallelMoE(config, max_num_tokens=max_num_tokens, group=group, device=device, mode=mode,
                              **kwargs)
    c, dev = config, layer.device
    h, i = c.hidden_size, c.intermediate_size
    gate_weight, bias, tid2eid = read_router(tensors, prefix, c)
    w13, w2, l1_local, l2s = read_experts(tensors, prefix, range(layer.expert_start, layer.expert_stop), h, i)
    shared_w13 = shared_w2 = None
    shared_scales = (None, None)
    if c.shared_intermediate_size:
        shared_w13, shared_w2, shared_scales = read_shared_expert(tensors, prefix, h, c.shared_intermediate_size)
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
