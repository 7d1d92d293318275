"""Expert-parallel NVFP4 MoE block: the routed experts split over the ranks of a process group.

Ownership: with world size W and E routed experts (E % W == 0), rank r owns experts
``[r * E/W, (r + 1) * E/W)`` (contiguous ranges). The gate, the correction bias, the hash table and the shared
expert are replicated on every rank.

Pipeline of :meth:`ExpertParallelMoE.forward` on each rank's own T tokens:

1. routing, locally, with the router of :class:`~megamoe.layers.moe.Nvfp4MoE` (``megamoe.ops.moe.route``:
   score routing with correction bias / groups, or hash routing from ``tid2eid`` and the token ids);
2. local dispatch (``megamoe.ops.moe.dispatch``): the T*k (token, slot) pairs sorted stably by expert, which
   sorts them by destination rank too (contiguous ownership);
3. counts first: ``all_to_all_single`` of the (E,) per-expert pair counts -> ``C`` (W, E/W), the rows source
   rank s sends for each local expert l;
4. rows: ``all_to_all_single`` of the gathered bf16 token rows (``x[row_index]``; w4a4 with static scales:
   the already quantized rows) into the receive buffer, ordered by source rank, then local expert, then the
   sender's token order;
5. local grouped GEMMs with the existing ops: ``nvfp4_grouped_mm(recv, w13, offsets, row_index=..., swiglu)``
   then ``nvfp4_grouped_mm(inter, w2, offsets)``; ``row_index`` reorders the received rows *expert-major*
   (expert l: source 0's rows, then source 1's, ...), so each expert's segment holds exactly the rows, in the
   same order, that the single-process layer's segment holds for the concatenated batch (rank 0's tokens,
   then rank 1's, ...);
6. the expert outputs are gathered back to source order and returned with a second ``all_to_all_single``;
7. combine with ``megamoe.ops.moe.combine``: the same kernel, slot order and float32 accumulation as
   ``Nvfp4MoE``: shared expert first then slots 0..k-1; or, where ``Nvfp4MoE`` fuses the shared expert
   (T <= ``fuse_shared_max_tokens``), slots 0..k-1 then the shared expert as slot k with weight 1.0. The
   shared expert runs locally (:class:`~megamoe.layers.moe.Nvfp4SharedExpert`) on the rank's own tokens.

Every row-wise result is therefore the single-process result: bit for bit on the CPU reference path (where
the rows of each matmul are the same rows), see ``tests/distributed/``.

Two exchange modes, chosen per call (``capacity=``), the same on every rank for one step:

* **exact** (default; prefill, outside CUDA graphs): after the counts exchange the host reads the W send and
  W receive totals (one device->host copy) and the row all-to-alls use exact split sizes; the buffers are
  prefixes of the preallocated ones when they fit, else exact-size allocations.
* **capacity** (decode, CUDA-graph capturable, no host reads): every rank pair has a fixed block of
  ``cap = capacity_tokens * top_k`` rows (the worst case: all of a rank's pairs to one peer); counts are
  exchanged on the device; the sender scatters its rows into its peer slots, padding rows are never part of
  an expert segment (the grouped GEMMs write them as zeros) and the combine reads only valid rows. The rows move
  by NCCL all-to-alls (whole blocks) or, with ``exchange="p2p"`` (the default on one host,
  :mod:`~megamoe.distributed.peer_exchange`), by peer-to-peer stores of the valid rows only, with the counts.

The send packing (steps 2-4) and the receive order (step 5) are one kernel each on CUDA
(``megamoe/kernels/ep_exchange.py``; their PyTorch oracles in ``megamoe/reference/ep_exchange.py`` run the CPU
path).

Memory of the capacity mode, per rank, with R = W * capacity_tokens * top_k rows, bf16:
send R*H, receive R*H, intermediate R*I (+ R*I for static w4a4), expert output R*H, return send R*H and
return receive (R + max_num_tokens)*H, i.e. about ``2 * R * (5*H + I)`` bytes (+ ``2*R*I`` for w4a4 static
scales), plus int32 indices of 2*R (int64 of R more for static w4a4); with ``exchange="p2p"`` the receive and
return buffers live in the symmetric-memory workspace. Example: V4-Flash (H=4096, I=2048, k=6), W=8, capacity_tokens=64:
R = 3072 rows -> 2 * 3072 * (20480 + 2048) = 138 MB per MoE layer's buffers (they can be shared between
layers by the model: they are workspace, not state). The exact mode reuses these buffers when the step fits
and allocates ``(received pairs) * (3*H + I) * 2`` bytes otherwise.

Process groups: NCCL for CUDA layers, gloo for CPU layers (checked); the layer's constructor and
:meth:`load_weights` are collectives that check the settings (and the replicated weights' checksums) are
the same on every rank and raise the same ``ValueError`` on every rank otherwise.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..format.tensor import NVFP4Tensor
from ..layers import moe as moe_layer
from ..layers.moe import (DISPATCH_KERNEL_MAX_PAIRS, FUSE_SHARED_MAX_TOKENS, MODES, Nvfp4SharedExpert,
                          _check_hidden, _check_nvfp4, _quant_roundtrip, check_router_weights, dispatch_buffers)
from ..models.config import MoEConfig
from ..ops import gemm as gemm_ops
from ..ops import moe as moe_ops
from ..ops._dispatch import resolve_device, use_triton
from ..kernels import ep_exchange
from .comm import check_backend, check_same_across_ranks, tensor_checksum
from .peer_exchange import PeerExchange, peer_exchange_available


def expert_range(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """The contiguous routed-expert range ``[start, stop)`` owned by ``rank`` (E % world_size must be 0)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank/world_size: expected 0 <= rank < world_size, got {rank}/{world_size}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the world size {world_size}: expert "
                         "parallelism gives every rank the same number of experts")
    per = num_experts // world_size
    return rank * per, (rank + 1) * per


def slice_experts(weight: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Experts ``[start, stop)`` of a stacked (E, N, K) NVFP4Tensor (global scale 0-d, (E,1,1) or (E,N,1))."""
    gs = weight.global_scale
    if gs.dim() == 3 and gs.shape[0] != 1:
        gs = gs[start:stop]
    return NVFP4Tensor(weight.data[start:stop].contiguous(), weight.block_scale[start:stop].contiguous(),
                       gs.contiguous(), (stop - start,) + tuple(weight.shape[1:]), weight.row_interleave)


class ExpertParallelMoE:
    """DeepSeek-V4-style MoE block with its routed experts spread over a process group (see module docstring).

    config: :class:`~megamoe.models.MoEConfig` (same on every rank). max_num_tokens: the most tokens one rank
    passes to a forward. group: the process group (default: the world). capacity_tokens: the most tokens per
    rank in capacity (CUDA-graph) mode (default ``max_num_tokens``); sizes the preallocated exchange buffers.
    mode / fuse_shared_expert / fuse_shared_max_tokens / dispatch_backend / router_backend: as
    :class:`~megamoe.layers.moe.Nvfp4MoE` (the fuse settings choose the combine order that matches it; the
    shared expert itself always runs on the rank's own tokens).
    exchange: how capacity mode moves rows: "nccl" (``all_to_all_single``), "p2p" (peer-to-peer stores into a
    symmetric-memory workspace, :mod:`~megamoe.distributed.peer_exchange`; CUDA ranks of one host) or "auto"
    (p2p when every rank is a CUDA rank of one host with symmetric memory and the world has >= 2 ranks, else
    nccl). Both move the same rows to the same places: the outputs are equal bit for bit. Exact mode always
    uses NCCL / gloo.

    Attributes: ``rank``, ``world_size``, ``expert_start``, ``expert_stop``, ``num_local_experts``,
    ``exchange`` ("nccl" or "p2p", the one in use).
    The constructor is a collective over ``group``.
    """

    def __init__(self, config: MoEConfig, *, max_num_tokens: int, group=None, device="cpu", mode: str = "w4a16",
                 capacity_tokens: int | None = None, fuse_shared_expert: bool = True,
                 fuse_shared_max_tokens: int | None = None, dispatch_backend: str = "auto",
                 router_backend: str = "triton", exchange: str = "auto"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE: torch.distributed is not initialised (init_process_group, or "
                               "megamoe.distributed.init_from_env under torchrun)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        error = None
        try:
            if not isinstance(config, MoEConfig):
                raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
            if mode not in MODES:
                raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
            if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
                raise ValueError(f"max_num_tokens: expected a positive int, got {max_num_tokens!r}")
            capacity_tokens = max_num_tokens if capacity_tokens is None else capacity_tokens
            if not isinstance(capacity_tokens, int) or not 1 <= capacity_tokens <= max_num_tokens:
                raise ValueError(f"capacity_tokens: expected an int in 1..max_num_tokens={max_num_tokens}, got "
                                 f"{capacity_tokens!r}")
            if dispatch_backend not in ("auto", "torch", "triton"):
                raise ValueError(f"dispatch_backend: expected 'auto', 'torch' or 'triton', got {dispatch_backend!r}")
            if router_backend not in ("torch", "triton"):
                raise ValueError(f"router_backend: expected 'torch' or 'triton', got {router_backend!r}")
            if exchange not in ("auto", "nccl", "p2p"):
                raise ValueError(f"exchange: expected 'auto', 'nccl' or 'p2p', got {exchange!r}")
            self.device = resolve_device(device)
            check_backend(self.group, self.device)
        except (TypeError, ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        fields = {} if error else {
            "config": dataclasses.asdict(config), "mode": mode, "max_num_tokens": max_num_tokens,
            "capacity_tokens": capacity_tokens, "fuse_shared_expert": bool(fuse_shared_expert),
            "fuse_shared_max_tokens": fuse_shared_max_tokens, "device_type": self.device.type,
            "world_size": self.world_size, "exchange": exchange,
        }
        check_same_across_ranks(self.group, "ExpertParallelMoE", fields, error)
        self.exchange = _agree_on_exchange(self.group, self.device, exchange)
        c = config
        self.expert_start, self.expert_stop = expert_range(c.num_experts, self.world_size, self.rank)
        self.num_local_experts = self.expert_stop - self.expert_start
        self.config, self.max_num_tokens, self.capacity_tokens, self.mode = (
            config, max_num_tokens, capacity_tokens, mode)
        self.dispatch_backend, self.router_backend = dispatch_backend, router_backend
        self.fused_shared = bool(fuse_shared_expert and c.shared_intermediate_size == c.intermediate_size)
        self.fuse_shared_max_tokens = (FUSE_SHARED_MAX_TOKENS if fuse_shared_max_tokens is None
                                       else fuse_shared_max_tokens)
        dev, h, k, w = self.device, c.hidden_size, c.top_k, self.world_size
        pairs = max_num_tokens * k
        self.capacity_rows = capacity_tokens * k  # rows per rank pair in capacity mode
        rows = w * self.capacity_rows  # receive rows in capacity mode
        self.gate_weight = self.correction_bias = self.tid2eid = None
        self.w13 = self.w2 = None  # local experts, checkpoint order (E/W, 2I, H), (E/W, H, I)
        self._w13_kernel = None
        self.input_scales: dict | None = None  # static w4a4: {"l1": 0-d, "l2": (E/W,)} or None
        self.shared = (
            Nvfp4SharedExpert(h, c.shared_intermediate_size, max_num_tokens=max_num_tokens, device=dev,
                              swiglu_limit=c.swiglu_limit, mode=mode)
            if c.shared_intermediate_size else None
        )
        self._dispatch_buffers = dispatch_buffers(pairs, c.num_experts, dev)
        self._route_weights = torch.empty((max_num_tokens, k), dtype=torch.float32, device=dev)
        self._route_ids = torch.empty((max_num_tokens, k), dtype=torch.int32, device=dev)
        # combine in Nvfp4MoE's fused order: slot k = the shared expert, weight 1.0, row R + t of the return buffer
        self._weights_ext = torch.ones((max_num_tokens, k + 1), dtype=torch.float32, device=dev)
        self._ids_ext = torch.zeros((max_num_tokens, k + 1), dtype=torch.int32, device=dev)
        self._inv_perm_ext = torch.empty((max_num_tokens, k + 1), dtype=torch.int32, device=dev)
        self._ret_row = torch.empty((max_num_tokens, k), dtype=torch.int32, device=dev)  # combine rows, no fusion
        self._x_q = torch.empty((max_num_tokens, h), dtype=torch.bfloat16, device=dev)
        # counts: (E,) sent per expert, (W * E/W,) received = C (W, E/W) row-major
        self._send_counts = torch.empty(c.num_experts, dtype=torch.int32, device=dev)
        self._recv_counts = torch.empty(c.num_experts, dtype=torch.int32, device=dev)
        self._host_counts = torch.empty(2 * w, dtype=torch.int64, pin_memory=False)
        # receive-side order (ep_local_order), sized for capacity mode; exact mode allocates when it does not fit
        self._row_index = torch.empty(rows, dtype=torch.int32, device=dev)
        self._back_index = torch.empty(rows, dtype=torch.int32, device=dev)
        self._row_expert = torch.empty(rows, dtype=torch.int64, device=dev) if mode == "w4a4" else None
        self._local_offsets = torch.empty(self.num_local_experts, dtype=torch.int32, device=dev)
        # capacity-mode exchange buffers (zeroed once: padding rows hold finite stale rows only)
        self._send_x = torch.zeros((max(rows, pairs), h), dtype=torch.bfloat16, device=dev)
        self._peer = (PeerExchange(self.group, dev, rows=rows, ret_rows=max(rows, pairs) + max_num_tokens, hidden=h,
                                   num_experts=c.num_experts) if self.exchange == "p2p" else None)
        self._recv_x = (self._peer.recv_x if self._peer is not None
                        else torch.zeros((rows, h), dtype=torch.bfloat16, device=dev))
        self._inter = torch.empty((rows, c.intermediate_size), dtype=torch.bfloat16, device=dev)
        self._inter_q = torch.empty_like(self._inter) if mode == "w4a4" else None
        self._y = torch.empty((rows, h), dtype=torch.bfloat16, device=dev)
        self._y_back = torch.empty((rows, h), dtype=torch.bfloat16, device=dev)
        self._ret = (self._peer.ret if self._peer is not None
                     else torch.zeros((max(rows, pairs) + max_num_tokens, h), dtype=torch.bfloat16, device=dev))
        self._out = torch.empty((max_num_tokens, h), dtype=torch.bfloat16, device=dev)
        self.last_routing = None  # (topk_weights, topk_ids) of the last forward: views of layer buffers

    # ------------------------------------------------------------------ weights
    def load_weights(self, gate_weight, correction_bias, w13: NVFP4Tensor, w2: NVFP4Tensor,
                     shared_w13: NVFP4Tensor | None = None, shared_w2: NVFP4Tensor | None = None, *,
                     tid2eid: torch.Tensor | None = None) -> None:
        """Install this rank's weights (a collective: checks the replicated ones agree on every rank).

        gate_weight (E, H), correction_bias (E,) or None, tid2eid (vocab, k) or None, shared_w13 (2*Is, H),
        shared_w2 (H, Is): replicated, as :meth:`Nvfp4MoE.load_weights`. w13 (E/W, 2I, H) rows [gate; up] and
        w2 (E/W, H, I): only this rank's experts ``[expert_start, expert_stop)`` (see :func:`slice_experts`).
        """
        c, dev, el = self.config, self.device, self.num_local_experts
        error = None
        try:
            gate, bias, table = _check_router_weights(c, dev, gate_weight, correction_bias, tid2eid)
            _check_nvfp4(w13, "w13", (el, 2 * c.intermediate_size, c.hidden_size), dev)
            _check_nvfp4(w2, "w2", (el, c.hidden_size, c.intermediate_size), dev)
            if self.shared is not None and (shared_w13 is None or shared_w2 is None):
                raise ValueError("shared_w13/shared_w2: the config has a shared expert; got None")
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        fields = {} if error else {
            "gate_weight": tensor_checksum(gate), "correction_bias": tensor_checksum(bias),
            "tid2eid": tensor_checksum(table),
            "shared": None if self.shared is None else (tensor_checksum(shared_w13.data),
                                                        tensor_checksum(shared_w2.data)),
        }
        check_same_across_ranks(self.group, "ExpertParallelMoE.load_weights", fields, error)
        self.gate_weight, self.correction_bias, self.tid2eid = gate, bias, table
        self.w13, self.w2 = w13, w2
        if self.shared is not None:
            self.shared.load_weights(shared_w13, shared_w2)
        self._w13_kernel = gemm_ops.interleave_gate_up(w13)
        self._w2_kernel = w2

    def set_input_scales(self, l1: torch.Tensor, l2: torch.Tensor, shared_l1=None, shared_l2=None) -> None:
        """Static w4a4 scales: l1 0-d (all experts), l2 (E/W,) this rank's experts, shared ones 0-d.

        As :meth:`Nvfp4MoE.set_input_scales`, including its fused-shared rule (one L1 scale = the max of both),
        so the numerics match the single-process layer's. Local (not a collective).
        """
        el = self.num_local_experts
        if not isinstance(l2, torch.Tensor) or tuple(l2.shape) != (el,):
            raise ValueError(f"l2: expected this rank's ({el},) scales, got "
                             f"{tuple(l2.shape) if isinstance(l2, torch.Tensor) else type(l2).__name__}")
        if not isinstance(l1, torch.Tensor) or l1.dim() != 0 or not l1.is_floating_point():
            raise ValueError(f"l1: expected a 0-d floating-point tensor, got {l1!r}")
        for name, t in (("l1", l1), ("l2", l2), ("shared_l1", shared_l1), ("shared_l2", shared_l2)):
            if t is not None and t.numel() and not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise ValueError(f"{name}: static input scales must be finite and > 0")
        l1, l2 = l1.float().to(self.device), l2.float().to(self.device)
        if self.shared is not None and shared_l1 is not None and shared_l2 is not None:
            s_l1 = shared_l1.float().to(self.device).reshape(())
            if self.fused_shared:
                l1 = s_l1 = torch.maximum(l1, s_l1)
            self.shared.input_scales = {"l1": s_l1, "l2": shared_l2.float().to(self.device).reshape(())}
        elif self.fused_shared:
            raise ValueError("shared_l1/shared_l2: the fused shared expert needs its static scales too")
        self.input_scales = {"l1": l1, "l2": l2}

    @classmethod
    def random(cls, config: MoEConfig, *, seed: int = 0, hash_vocab: int | None = None, **kwargs):
        """This rank's share of ``Nvfp4MoE.random(config, seed=seed, hash_vocab=hash_vocab)``: the same weights
        (same per-tensor, per-expert generators), but only the local experts are drawn and quantized."""
        layer = cls(config, **kwargs)
        dev, c = layer.device, config
        h, i, si = c.hidden_size, c.intermediate_size, c.shared_intermediate_size

        def gen(tag: int, index: int = 0) -> torch.Generator:
            return torch.Generator(device=dev).manual_seed(moe_layer._sub_seed(seed, tag, index))

        def randn(shape, scale, tag, index=0):
            return (torch.randn(*shape, generator=gen(tag, index), device=dev) * scale).to(torch.bfloat16)

        gate, bias, tid2eid = moe_layer._random_router(c, gen, dev, hash_vocab)
        e0, el = layer.expert_start, layer.num_local_experts
        w13 = moe_layer._random_experts(el, (2 * i, h), h ** -0.5, lambda j: gen(4, e0 + j), dev, None, "w13")
        w2 = moe_layer._random_experts(el, (h, i), i ** -0.5, lambda j: gen(5, e0 + j), dev, None, "w2")
        s13 = moe_layer.quantize_weight(randn((2 * si, h), h ** -0.5, 6)) if si else None
        s2 = moe_layer.quantize_weight(randn((h, si), si ** -0.5, 7)) if si else None
        layer.load_weights(gate, bias, w13, w2, s13, s2, tid2eid=tid2eid)
        return layer

    # ------------------------------------------------------------------ forward
    @property
    def hash_routed(self) -> bool:
        return self.tid2eid is not None

    def route(self, hidden_states: torch.Tensor, out=None, token_ids: torch.Tensor | None = None):
        """(topk_weights (T, k) fp32, topk_ids (T, k) int32): the single-process router on this rank's tokens."""
        c = self.config
        if self.hash_routed and token_ids is None:
            raise ValueError("token_ids: this layer is hash-routed (tid2eid loaded); pass the (T,) token ids")
        return moe_ops.route(
            hidden_states, self.gate_weight, self.correction_bias, top_k=c.top_k, scoring_func=c.scoring_func,
            n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, backend=self.router_backend, out=out,
            token_ids=token_ids if self.hash_routed else None, tid2eid=self.tid2eid,
        )

    def _token_ids(self, token_ids, num_tokens: int):
        if token_ids is not None:
            if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"token_ids: expected an int32/int64 torch.Tensor, got "
                                f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}")
            if tuple(token_ids.shape) != (num_tokens,) or token_ids.device != self.device:
                raise ValueError(f"token_ids: expected shape ({num_tokens},) on {self.device}, got "
                                 f"{tuple(token_ids.shape)} on {token_ids.device}")
        if not self.hash_routed:
            return None
        if token_ids is None:
            raise ValueError("token_ids: this layer is hash-routed (tid2eid loaded); pass the (T,) token ids")
        return token_ids

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None, *,
                capacity: bool = False, combine_tokens: int | None = None) -> torch.Tensor:
        """(T, H) bf16 -> (T, H) bf16 (a view of the layer's output buffer) for this rank's T tokens.

        A collective: every rank of the group calls it for the same step with the same ``capacity`` (its own
        T may differ, 0 included). capacity=False: exact split sizes (reads 2W counts on the host; not
        capturable). capacity=True: fixed ``capacity_tokens * top_k`` rows per rank pair, no host reads,
        CUDA-graph capturable; needs T <= capacity_tokens. Both give the same result up to float32 summation
        order: the grouped GEMMs' kernels (row bands, tiles, split-K) are planned on the host from the received
        row count, which is the exact count in one mode and the capacity in the other, so on CUDA the two may
        differ in the last bits (H100, world 4, 16 tokens of V4-Flash); on the CPU path they are bit-identical.
        token_ids: (T,) int32/int64, required by a hash-routed layer.
        combine_tokens: the token count whose combine order to follow (default T): the single-process layer
        puts the shared expert last (fused) up to ``fuse_shared_max_tokens`` tokens, first above; a caller that
        splits one batch of N tokens over the ranks passes N so that every rank matches the N-token layer.
        """
        if self._w13_kernel is None:
            raise RuntimeError("ExpertParallelMoE: call load_weights() first")
        c = self.config
        _check_hidden(hidden_states, c.hidden_size, self.max_num_tokens, self.device)
        t = hidden_states.shape[0]
        token_ids = self._token_ids(token_ids, t)
        if capacity and t > self.capacity_tokens:
            raise ValueError(f"hidden_states: {t} tokens exceed capacity_tokens={self.capacity_tokens} (the "
                             "capacity-mode exchange buffers); use capacity=False or a larger capacity_tokens")
        k, w, el, e = c.top_k, self.world_size, self.num_local_experts, c.num_experts
        order_tokens = t if combine_tokens is None else combine_tokens
        shared_last = self.shared is not None and self.fused_shared and order_tokens <= self.fuse_shared_max_tokens
        pairs = t * k
        # 1-2. routing and the local dispatch (pairs sorted by expert = by destination rank): one launch for
        #      decode-sized batches (megamoe.ops.moe.route_dispatch picks it from the token count)
        backend = self.dispatch_backend
        if backend == "auto":
            backend = "triton" if pairs <= DISPATCH_KERNEL_MAX_PAIRS else "torch"
        if t == 0:
            topk_weights, topk_ids = self._route_weights[:0], self._route_ids[:0]
            d = moe_ops.dispatch(topk_ids, e, buffers=self._dispatch_buffers, backend=backend)
        else:
            c_out = (self._weights_ext, self._ids_ext) if shared_last else (self._route_weights, self._route_ids)
            topk_weights, topk_ids, d = moe_ops.route_dispatch(
                hidden_states, self.gate_weight, self.correction_bias, top_k=k, scoring_func=c.scoring_func,
                n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                routed_scaling_factor=c.routed_scaling_factor, num_groups=e, slots=k, out=c_out,
                buffers=self._dispatch_buffers, token_ids=token_ids if self.hash_routed else None,
                tid2eid=self.tid2eid, backend=self.router_backend, dispatch_backend=backend)
        self.last_routing = (topk_weights, topk_ids)
        offsets = d["expert_offsets"]
        # 3. pack (one launch on the GPU): per-expert send counts, the token rows into their send rows, and the
        #    return row of every pair for the combine (ep_exchange's docstring)
        impl = _exchange_impl(hidden_states)
        cap = self.capacity_rows if capacity else 0
        send_rows = w * self.capacity_rows if capacity else pairs
        x = hidden_states
        static = self.mode == "w4a4" and self.input_scales is not None
        gemm_mode = "w4a16" if static else self.mode
        if static and t:
            x = _quant_roundtrip(hidden_states, self.input_scales["l1"], self._x_q[:t])
        send_x = self._buffer(self._send_x, send_rows, c.hidden_size)
        ret_row = self._inv_perm_ext[:t] if shared_last else self._ret_row[:t]
        impl.ep_pack(x, d["inv_perm"], d["sorted_expert"], offsets, send_x, self._send_counts, ret_row, top_k=k,
                     num_local_experts=el, capacity_rows=cap, shared_base=send_rows if shared_last else None)
        # 4. counts, then rows (ordered by source rank, then local expert, then the sender's token order)
        p2p = capacity and self._peer is not None
        recv_counts = self._peer.recv_counts if p2p else self._recv_counts
        if p2p:  # rows and counts stored into the peers' workspaces, then the barrier
            ep_exchange.ep_put_rows(send_x, self._peer.peer_base, self._peer.recv_x_offset, self._send_counts,
                                    capacity_rows=cap, my_rank=self.rank, counts_dst_offset=self._peer.counts_offset)
            self._peer.barrier()
        else:
            dist.all_to_all_single(recv_counts, self._send_counts, group=self.group)
        if capacity:
            recv_rows = send_rows
            in_splits = out_splits = None
        else:  # one host read of the 2W totals
            send_per_peer = self._send_counts.view(w, el).long().sum(1)
            recv_per_peer = recv_counts.view(w, el).long().sum(1)
            self._host_counts.copy_(torch.cat((send_per_peer, recv_per_peer)))
            host = self._host_counts.tolist()
            in_splits, out_splits = host[:w], host[w:]
            recv_rows = sum(out_splits)
        recv_x = self._buffer(self._recv_x, recv_rows, c.hidden_size)
        if not p2p:
            dist.all_to_all_single(recv_x, send_x, out_splits, in_splits, group=self.group)
        # 5. local experts: expert-major row order (expert l: source 0's rows, source 1's, ...)
        row_index = self._vector(self._row_index, recv_rows)
        back_index = self._vector(self._back_index, recv_rows)
        row_expert = self._vector(self._row_expert, recv_rows) if static else None
        impl.ep_local_order(recv_counts, row_index, back_index, self._local_offsets, row_expert,
                            world_size=w, capacity_rows=cap)
        local_offsets = self._local_offsets
        # distinct top-k experts per token: a local expert receives at most one row per source token (sizes the
        # GEMM launches only; results never depend on it)
        max_rows = min(recv_rows, w * (self.capacity_tokens if capacity else self.max_num_tokens))
        y_back = self._buffer(self._y_back, recv_rows, c.hidden_size)
        if recv_rows:
            inter = gemm_ops.nvfp4_grouped_mm(
                recv_x, self._w13_kernel, local_offsets, mode=gemm_mode,
                out=self._buffer(self._inter, recv_rows, c.intermediate_size), row_index=row_index,
                activation="swiglu", swiglu_limit=c.swiglu_limit, max_rows_per_expert=max_rows,
            )
            if static:
                row_scale = self.input_scales["l2"].index_select(0, row_expert).unsqueeze(1)
                inter = _quant_roundtrip(inter, row_scale,
                                         self._buffer(self._inter_q, recv_rows, c.intermediate_size))
            y = gemm_ops.nvfp4_grouped_mm(inter, self._w2_kernel, local_offsets, mode=gemm_mode,
                                          out=self._buffer(self._y, recv_rows, c.hidden_size),
                                          max_rows_per_expert=max_rows)
            # 6. back to source order (the p2p stores gather through back_index themselves), second all-to-all
            if not p2p:
                torch.index_select(y, 0, back_index, out=y_back)
        ret = self._buffer(self._ret, send_rows + t, c.hidden_size)
        if p2p:  # each source's rows back into its workspace, then the barrier
            ep_exchange.ep_put_rows(y, self._peer.peer_base, self._peer.ret_offset, recv_counts,
                                    capacity_rows=cap, my_rank=self.rank, src_index=back_index)
            self._peer.barrier()
        else:
            dist.all_to_all_single(ret[:send_rows], y_back, in_splits, out_splits, group=self.group)
        out = self._out[:t]
        if t == 0:
            return out
        # 7. combine in the single-process layer's order (ret_row: the pack's return rows, -1 = dropped pair)
        if shared_last:
            self.shared.forward(hidden_states, out=ret[send_rows:send_rows + t])
            return moe_ops.combine(ret, ret_row.view(-1), self._weights_ext[:t], None, out=out)
        shared = self.shared.forward(hidden_states) if self.shared is not None else None
        return moe_ops.combine(ret, ret_row.view(-1), topk_weights, shared, out=out)

    __call__ = forward

    @staticmethod
    def _buffer(buf: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """The first ``rows`` rows of a preallocated buffer, or an exact-size one when it does not fit."""
        if rows <= buf.shape[0]:
            return buf[:rows]
        return torch.empty((rows, width), dtype=buf.dtype, device=buf.device)

    @staticmethod
    def _vector(buf: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` elements of a preallocated 1-D buffer, or an exact-size one when it does not fit."""
        return buf[:n] if n <= buf.shape[0] else torch.empty(n, dtype=buf.dtype, device=buf.device)

    # ------------------------------------------------------------ CUDA graphs
    def capture(self, num_tokens: int, *, warmup: int = 2):
        """Capture a capacity-mode forward for ``num_tokens`` tokens into a CUDA graph (NCCL all-to-alls
        inside). A collective: every rank captures (and later replays) together. Returns
        ``run(hidden_states, token_ids=None) -> out`` as :meth:`Nvfp4MoE.capture`."""
        if self.device.type != "cuda":
            raise RuntimeError("capture: CUDA graphs need a CUDA layer")
        if not 1 <= num_tokens <= self.capacity_tokens:
            raise ValueError(f"num_tokens: expected 1..{self.capacity_tokens} (capacity_tokens), got {num_tokens}")
        static_in = torch.zeros((num_tokens, self.config.hidden_size), dtype=torch.bfloat16, device=self.device)
        static_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device) if self.hash_routed else None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.forward(static_in, static_ids, capacity=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.forward(static_in, static_ids, capacity=True)

        def run(hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
            if tuple(hidden_states.shape) != tuple(static_in.shape):
                raise ValueError(f"hidden_states: the graph was captured for shape {tuple(static_in.shape)}, "
                                 f"got {tuple(hidden_states.shape)}")
            if static_ids is not None:
                if not isinstance(token_ids, torch.Tensor) or tuple(token_ids.shape) != (num_tokens,):
                    raise ValueError(f"token_ids: the hash-routed graph needs ({num_tokens},) token ids")
                static_ids.copy_(token_ids)
            static_in.copy_(hidden_states)
            graph.replay()
            return static_out

        run.graph, run.static_input, run.static_output = graph, static_in, static_out
        return run

    def exchange_bytes(self, capacity: bool, received_pairs: int | None = None) -> int:
        """Bytes this rank receives in the two row all-to-alls of one forward (bf16 rows)."""
        rows = self.world_size * self.capacity_rows if capacity else int(received_pairs or 0)
        return 2 * rows * self.config.hidden_size * 2


def _agree_on_exchange(group, device: torch.device, requested: str) -> str:
    """The capacity-mode exchange every rank uses (a collective): "p2p" when requested or "auto" and every rank
    is a CUDA rank of one host with symmetric memory (and the world has >= 2 ranks), else "nccl"; a "p2p" request
    that some rank cannot serve raises the same ValueError on every rank."""
    import socket

    ok, why = peer_exchange_available(device)
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), ok, why), group=group)
    hosts = {g[0] for g in gathered}
    problems = [f"rank {r}: {g[2]}" for r, g in enumerate(gathered) if not g[1]]
    if len(hosts) > 1:
        problems.append(f"the ranks are on {len(hosts)} hosts")
    if requested == "p2p" and problems:
        raise ValueError("exchange='p2p': peer-to-peer stores need CUDA ranks of one host with symmetric memory; "
                         + "; ".join(problems))
    if requested == "nccl" or problems or (requested == "auto" and world < 2):
        return "nccl"
    return "p2p"


def _exchange_impl(t: torch.Tensor):
    """The exchange planning for ``t``'s device: the kernels (CUDA, or the interpreter with TRITON_INTERPRET=1)
    or their PyTorch oracles (the CPU path); both write the same values."""
    if use_triton(t):
        from ..kernels import ep_exchange
        return ep_exchange
    from ..reference import ep_exchange
    return ep_exchange


_check_router_weights = check_router_weights  # the single-GPU layer's rules
