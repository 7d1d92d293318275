"""The MoE block of an expert-parallel model: attention and every other layer replicated, experts split.

:class:`TokenSplitMoE` has the interface the decoder uses of :class:`~megamoe.layers.moe.Nvfp4MoE`
(``load_weights``, ``forward(x, token_ids=None)``, ``release_reference_weights``, ``weight_bytes``) and runs
an :class:`~megamoe.distributed.ExpertParallelMoE` underneath:

1. every rank holds the step's same N tokens (the replicated layers computed them identically);
2. rank r takes the contiguous slice ``[r * P, min((r + 1) * P, N))`` with ``P = ceil(N / W)`` and runs the
   expert-parallel forward on it (routing local, all-to-all dispatch, its own experts, all-to-all back,
   combine), following the N-token layer's combine order (``combine_tokens=N``);
3. ``all_gather`` of the (P, H) slices (padded) puts the N output rows back on every rank, in token order.

Each row is computed from the same rows, weights and order as :class:`Nvfp4MoE` on the N tokens, so the
block is bit for bit the single-process block on the CPU reference path (``tests/distributed/``).

Exchange mode per call, a host decision on shapes only (N is the same on every rank): the capacity mode
(fixed buffers, no host reads, CUDA-graph capturable) when ``P <= capacity_tokens = ceil(max_batch / W)``
(every decode step), the exact mode otherwise (prefill chunks). Both give the same outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..format.tensor import NVFP4Tensor
from ..models.config import MoEConfig
from .ep_moe import ExpertParallelMoE, slice_experts


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TokenSplitMoE:
    """Expert-parallel MoE block for a model with replicated tokens (see module docstring).

    config: :class:`~megamoe.models.MoEConfig`. max_num_tokens: the most tokens of one call (all ranks
    together, e.g. max(decode batch, prefill chunk)). max_batch: the largest decode batch (sizes the capacity
    buffers). group: the process group (default: the world). The constructor is a collective.

    Attributes: ``config``, ``rank``, ``world_size``, ``expert_start``, ``expert_stop`` (the routed experts this
    rank holds), ``ep`` (the :class:`ExpertParallelMoE`).
    """

    def __init__(self, config: MoEConfig, *, max_num_tokens: int, max_batch: int, group=None, device="cpu",
                 mode: str = "w4a16"):
        if not isinstance(max_batch, int) or not 1 <= max_batch <= max_num_tokens:
            raise ValueError(f"max_batch: expected an int in 1..max_num_tokens={max_num_tokens}, got {max_batch!r}")
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        local_max = _cdiv(max_num_tokens, world)
        self.ep = ExpertParallelMoE(config, max_num_tokens=local_max, group=group, device=device, mode=mode,
                                    capacity_tokens=min(local_max, _cdiv(max_batch, world)))
        self.config, self.group = config, group
        self.rank, self.world_size = self.ep.rank, world
        self.expert_start, self.expert_stop = self.ep.expert_start, self.ep.expert_stop
        self.max_num_tokens = max_num_tokens
        dev, h = self.ep.device, config.hidden_size
        self._slices = torch.zeros((world, local_max, h), dtype=torch.bfloat16, device=dev)  # all_gather target
        self._send = torch.zeros((local_max, h), dtype=torch.bfloat16, device=dev)
        self._out = torch.empty((world * local_max, h), dtype=torch.bfloat16, device=dev)

    @property
    def local_experts(self) -> range:
        """The routed expert ids whose weights this rank loads."""
        return range(self.expert_start, self.expert_stop)

    def load_weights(self, gate_weight, correction_bias, w13: NVFP4Tensor, w2: NVFP4Tensor,
                     shared_w13: NVFP4Tensor | None = None, shared_w2: NVFP4Tensor | None = None, *,
                     tid2eid: torch.Tensor | None = None) -> None:
        """As :meth:`Nvfp4MoE.load_weights`; w13 (E or E/W, 2I, H) / w2 (E or E/W, H, I): all routed experts
        (this rank keeps its own) or only :attr:`local_experts`. A collective."""
        e = self.config.num_experts
        if isinstance(w13, NVFP4Tensor) and w13.shape[0] == e and self.world_size > 1:
            w13 = slice_experts(w13, self.expert_start, self.expert_stop)
        if isinstance(w2, NVFP4Tensor) and w2.shape[0] == e and self.world_size > 1:
            w2 = slice_experts(w2, self.expert_start, self.expert_stop)
        self.ep.load_weights(gate_weight, correction_bias, w13, w2, shared_w13, shared_w2, tid2eid=tid2eid)

    def release_reference_weights(self) -> None:
        """The checkpoint-order copy of the local w13 (the kernels read the interleaved one)."""
        self.ep.w13 = None

    def weight_bytes(self, experts_touched: int | None = None) -> int:
        """Device bytes of this rank's weights: its routed experts, the shared expert and the gate."""
        ep = self.ep
        total = ep._w13_kernel.nbytes() + ep._w2_kernel.nbytes() + ep.gate_weight.numel() * 2
        if ep.shared is not None:
            total += ep.shared.w13.nbytes() + ep.shared.w2.nbytes()
        return total

    @property
    def last_routing(self):
        raise RuntimeError("last_routing: record_decisions is single-process only (each rank routes a slice)")

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) bf16, the same on every rank -> (N, H) bf16 (a view of a layer buffer), the same on every
        rank. token_ids: (N,) int32/int64 for a hash-routed layer. A collective."""
        n = hidden_states.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"hidden_states: {n} tokens exceed max_num_tokens={self.max_num_tokens}")
        per = _cdiv(n, self.world_size)
        lo = min(self.rank * per, n)
        hi = min(lo + per, n)
        ids = token_ids[lo:hi] if token_ids is not None else None
        capacity = per <= self.ep.capacity_tokens
        y = self.ep.forward(hidden_states[lo:hi], ids, capacity=capacity, combine_tokens=n)
        send = self._send[:per]
        send[:hi - lo].copy_(y)
        parts = [self._slices[r, :per] for r in range(self.world_size)]  # contiguous views
        dist.all_gather(parts, send, group=self.group)
        out = self._out[:self.world_size * per]
        out.view(self.world_size, per, -1).copy_(self._slices[:, :per])  # rank r's rows at r * per
        return out[:n]

    __call__ = forward

