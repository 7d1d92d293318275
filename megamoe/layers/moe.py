"""NVFP4 DeepSeek-V4 MoE block and shared expert for Hopper (and CPU).

Pipeline of :meth:`Nvfp4MoE.forward` (all on the device, no host syncs):

1. router (``megamoe.ops.moe.route``): fp32 gate GEMM and scoring in torch,
   then one Triton kernel (``router_backend="triton"``) for correction bias,
   top-k with the reference's tie-break, renormalisation, routed scaling
   (ids identical to the reference router; group-limited configs use torch);
2. dispatch (``megamoe.ops.moe.dispatch``): stable grouping of the T*k pairs by
   expert -> ``expert_offsets``, ``row_index`` (token of each sorted row),
   ``inv_perm``; one Triton launch up to ``DISPATCH_KERNEL_MAX_PAIRS`` pairs,
   torch sort + searchsorted above (identical outputs);
3. L1: ``nvfp4_grouped_mm(x, w13, expert_offsets, row_index=row_index,
   activation="swiglu")`` -- the row gather is fused into the GEMM's A loads and
   SwiGLU + clamp into its epilogue (w13 stored gate/up *interleaved*, done once
   at load);
4. L2: ``nvfp4_grouped_mm(inter, w2, expert_offsets)``;
5. combine kernel: ``out[t] = sum_j w[t, j] * y[inv_perm[t*k + j]]`` (float32, one
   bf16 rounding). The shared expert, when as wide as a routed expert
   (DeepSeek-V4), is appended to the stacked weights as group E and every token
   gets it as an extra slot with weight 1.0, so it runs *inside* the same two
   grouped GEMMs (``fuse_shared_expert=True``, default); otherwise it runs as
   its own one-group pipeline and the combine adds its output.

Activation modes: ``"w4a16"`` (bf16 activations) and ``"w4a4"``: the inputs of
both GEMMs are quantized to NVFP4 and decoded back to bf16 before the bf16
tensor-core GEMM (Hopper has no FP4 MMA; this reproduces W4A4 numerics). The
activation global scales are either computed at run time on the device
(per-row, default) or static: set by :meth:`Nvfp4MoE.calibrate` (the seeds'
``compute_activation_global_scales``) or loaded from a checkpoint's
``input_scale``; L2's static scale is per expert, gathered per sorted row on
the device.

Buffers are preallocated for ``max_num_tokens``; ``forward`` returns a view of
the layer's output buffer (valid until the next call; clone it to keep it).
CUDA graphs: :meth:`capture` (warm-up, capture, returns a replay callable), or
by hand: warm up ``forward`` once on a side stream, then capture it with
``torch.cuda.graph`` on a static input tensor. ``torch.compile``: call
:meth:`compiled_forward` (the ``megamoe::moe_layer_forward`` custom op, opaque to
the compiler, with a fake implementation).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from ..format.tensor import NVFP4Tensor
from ..models.config import MoEConfig
from ..ops import gemm as gemm_ops
from ..ops import moe as moe_ops
import importlib

quantize_ops = importlib.import_module("megamoe.ops.quantize")  # the module (ops/__init__ re-exports a function of that name)
from ..reference import moe as moe_reference

MODES = ("w4a16", "w4a4")


def _resolve_device(device) -> torch.device:
    """'cuda' -> 'cuda:<current>' so that device comparisons with tensors' devices hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_nvfp4(t, name: str, shape: tuple, device) -> None:
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"{name}: expected an NVFP4Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected logical shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def _check_hidden(hidden_states, hidden: int, max_num_tokens: int, device) -> None:
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(f"hidden_states: expected bfloat16, got {hidden_states.dtype}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states: expected shape (T, {hidden}), got {tuple(hidden_states.shape)}")
    if hidden_states.shape[0] > max_num_tokens:
        raise ValueError(
            f"hidden_states: {hidden_states.shape[0]} tokens exceed max_num_tokens={max_num_tokens} "
            "(the preallocated buffers); split the batch or build the layer with a larger max_num_tokens"
        )
    if hidden_states.device != torch.device(device):
        raise ValueError(f"hidden_states: expected device {device}, got {hidden_states.device}")


def _quant_roundtrip(x: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """bf16 -> NVFP4 (given global scale) -> bf16 into ``out`` (sync-free on the kernel path)."""
    if x.shape[0] == 0:
        return out
    return quantize_ops.dequantize(quantize_ops.quantize(x, global_scale), torch.bfloat16, out=out)


class Nvfp4SharedExpert:
    """Dense SwiGLU FFN with NVFP4 weights (DeepSeek's shared expert), one expert group.

    Weights: ``w13`` NVFP4Tensor (2*I, H), rows ``[gate(I); up(I)]`` (checkpoint
    order; interleaved internally once), ``w2`` NVFP4Tensor (H, I). forward:
    (T, H) bf16 -> (T, H) bf16 (a view of a preallocated buffer).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, max_num_tokens: int, device="cpu",
                 swiglu_limit: float | None = 10.0, mode: str = "w4a16"):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens: expected a positive int, got {max_num_tokens!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.max_num_tokens, self.device, self.mode = max_num_tokens, _resolve_device(device), mode
        self.swiglu_limit = swiglu_limit
        self.w13 = self.w2 = None  # checkpoint-order weights (reference)
        self._w13_kernel = self._w2_kernel = None  # (1, 2I, H) interleaved, (1, H, I)
        self.input_scales: dict | None = None  # static w4a4 scales {"l1": 0-d, "l2": 0-d} or None (dynamic)
        dev = self.device
        self._offsets = torch.empty(1, dtype=torch.int32, device=dev)
        self._x_q = torch.empty((max_num_tokens, hidden_size), dtype=torch.bfloat16, device=dev)
        self._inter = torch.empty((max_num_tokens, intermediate_size), dtype=torch.bfloat16, device=dev)
        self._inter_q = torch.empty_like(self._inter)
        self._out = torch.empty((max_num_tokens, hidden_size), dtype=torch.bfloat16, device=dev)

    def load_weights(self, w13: NVFP4Tensor, w2: NVFP4Tensor) -> None:
        _check_nvfp4(w13, "w13", (2 * self.intermediate_size, self.hidden_size), self.device)
        _check_nvfp4(w2, "w2", (self.hidden_size, self.intermediate_size), self.device)
        self.w13, self.w2 = w13, w2
        self._w13_kernel = gemm_ops.interleave_gate_up(_stack1(w13))
        self._w2_kernel = _stack1(w2)

    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, H) bf16 -> (T, H) bf16 = W2 @ swiglu(W13 @ x)."""
        if self._w13_kernel is None:
            raise RuntimeError("Nvfp4SharedExpert: call load_weights() first")
        _check_hidden(hidden_states, self.hidden_size, self.max_num_tokens, self.device)
        t = hidden_states.shape[0]
        out = self._out[:t] if out is None else out
        self._offsets.fill_(t)  # scalar fill: a kernel launch, no host read
        x, gemm_mode = hidden_states, self.mode
        static = self.mode == "w4a4" and self.input_scales is not None
        if static:
            x, gemm_mode = _quant_roundtrip(hidden_states, self.input_scales["l1"], self._x_q[:t]), "w4a16"
        inter = gemm_ops.nvfp4_grouped_mm(
            x, self._w13_kernel, self._offsets, mode=gemm_mode, out=self._inter[:t],
            activation="swiglu", swiglu_limit=self.swiglu_limit,
        )
        if static:
            inter = _quant_roundtrip(inter, self.input_scales["l2"], self._inter_q[:t])
        return gemm_ops.nvfp4_grouped_mm(inter, self._w2_kernel, self._offsets, mode=gemm_mode, out=out)

    __call__ = forward

    def reference_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 reference on decoded weights: (T, H) float32."""
        scales = self.input_scales or {}
        return moe_reference.expert_ffn(
            hidden_states, self.w13, self.w2, self.swiglu_limit, mode=self.mode,
            input_scale=scales.get("l1"), inter_scale=scales.get("l2"),
        )


def _stack1(t: NVFP4Tensor) -> NVFP4Tensor:
    gs = t.global_scale
    gs = gs.reshape(1, 1, 1) if gs.dim() == 0 else gs.unsqueeze(0)
    return NVFP4Tensor(t.data.unsqueeze(0), t.block_scale.unsqueeze(0), gs, (1,) + tuple(t.shape))


# Fused shared expert only up to this many tokens. H100, graph replay, with the Gluon decode kernel
# (benchmarks/results/moe_v5_fuse0*.md = separate, moe_v5_fuse64*.md = always fused), guide / V4-Flash dims:
# 1 token 181.8 -> 141.9 / 123.5 -> 90.0 us and 8 tokens 651.3 -> 608.2 / 354.6 -> 309.6 us (fused better);
# 16 tokens equal (1046 vs 1042 / 554.5 vs 556.6); 32 tokens 1579 -> 1679 / 831 -> 934 and 64 tokens
# 2087 -> 2317 / 1145 -> 1351 us (fused worse: the shared group's T rows loop over 8-row MMA tiles, each
# streaming its weights again).
FUSE_SHARED_MAX_TOKENS = 16
# "auto" dispatch uses the single-program Triton kernel (megamoe/kernels/moe_dispatch.py) up to this many
# (token, slot) pairs and the torch sort path above (the kernel is serial over 32-pair chunks).
DISPATCH_KERNEL_MAX_PAIRS = 512

_LAYERS: "weakref.WeakValueDictionary[int, Nvfp4MoE]" = weakref.WeakValueDictionary()
_LAYER_IDS = itertools.count()


class Nvfp4MoE:
    """DeepSeek-V4-style MoE block with NVFP4 expert weights (routed experts + shared expert).

    config: :class:`megamoe.models.MoEConfig`. max_num_tokens: the most tokens a
    forward may take (buffers are sized by it; more -> ValueError). mode:
    "w4a16" or "w4a4".

    Weights (:meth:`load_weights`): ``gate_weight`` (E, H) bf16,
    ``correction_bias`` (E,) fp32 or None, ``w13`` NVFP4Tensor (E, 2*I, H) rows
    ``[gate(I); up(I)]`` per expert, global scale 0-d, (E,1,1) or (E,2I,1);
    ``w2`` NVFP4Tensor (E, H, I); shared expert ``(2*Is, H)`` / ``(H, Is)``.
    """

    def __init__(self, config: MoEConfig, *, max_num_tokens: int, device="cpu", mode: str = "w4a16",
                 fuse_shared_expert: bool = True, fuse_shared_max_tokens: int | None = None,
                 dispatch_backend: str = "auto", router_backend: str = "triton"):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a MoEConfig, got {type(config).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens: expected a positive int, got {max_num_tokens!r}")
        if dispatch_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"dispatch_backend: expected 'auto', 'torch' or 'triton', got {dispatch_backend!r}")
        self.config, self.max_num_tokens, self.mode = config, max_num_tokens, mode
        self.dispatch_backend = dispatch_backend
        if router_backend not in ("torch", "triton"):
            raise ValueError(f"router_backend: expected 'torch' or 'triton', got {router_backend!r}")
        # "triton": torch scores + one selection kernel (identical ids; on CPU without the interpreter, torch)
        self.router_backend = router_backend
        self.device = dev = _resolve_device(device)
        c = config
        # The shared expert runs as routed expert number E (weight 1.0, every token) inside the same two grouped
        # GEMMs when its width equals the routed experts' (DeepSeek-V4: both 2048): one launch per GEMM, and
        # its tiles share the machine with the routed experts' instead of running after them.
        # It pays only at the smallest batches (see FUSE_SHARED_MAX_TOKENS); the choice is made on the host from the
        # token count (a shape), so each captured graph has one fixed path.
        self.fused_shared = bool(fuse_shared_expert and c.shared_intermediate_size == c.intermediate_size)
        self.fuse_shared_max_tokens = (FUSE_SHARED_MAX_TOKENS if fuse_shared_max_tokens is None
                                       else fuse_shared_max_tokens)
        self._slots = c.top_k + (1 if self.fused_shared else 0)  # rows per token in the grouped GEMMs
        self._groups = c.num_experts + (1 if self.fused_shared else 0)
        pairs = max_num_tokens * self._slots
        self.gate_weight = self.correction_bias = self.w13 = self.w2 = None
        self._w13_kernel = None
        self.input_scales: dict | None = None  # static w4a4: {"l1": 0-d, "l2": (E,)} or None (dynamic)
        self.shared = (
            Nvfp4SharedExpert(c.hidden_size, c.shared_intermediate_size, max_num_tokens=max_num_tokens, device=dev,
                              swiglu_limit=c.swiglu_limit, mode=mode)
            if c.shared_intermediate_size else None
        )
        self._dispatch_buffers = {
            "sorted_expert": torch.empty(pairs, dtype=torch.int32, device=dev),
            "perm": torch.empty(pairs, dtype=torch.int64, device=dev),
            "row_index": torch.empty(pairs, dtype=torch.int32, device=dev),
            "inv_perm": torch.empty(pairs, dtype=torch.int32, device=dev),
            "arange": torch.arange(pairs, dtype=torch.int32, device=dev),
            "experts": torch.arange(self._groups, dtype=torch.int32, device=dev),
            "expert_offsets": torch.empty(self._groups, dtype=torch.int32, device=dev),
        }
        self._route_weights = torch.empty((max_num_tokens, c.top_k), dtype=torch.float32, device=dev)
        self._route_ids = torch.empty((max_num_tokens, c.top_k), dtype=torch.int32, device=dev)
        if self.fused_shared:  # routing with the shared expert appended as slot k: id E, weight 1.0 (set once)
            self._ids_ext = torch.full((max_num_tokens, self._slots), c.num_experts, dtype=torch.int32, device=dev)
            self._weights_ext = torch.ones((max_num_tokens, self._slots), dtype=torch.float32, device=dev)
        self._x_q = torch.empty((max_num_tokens, c.hidden_size), dtype=torch.bfloat16, device=dev)
        self._inter = torch.empty((pairs, c.intermediate_size), dtype=torch.bfloat16, device=dev)
        self._inter_q = torch.empty_like(self._inter)
        self._expert_out = torch.empty((pairs, c.hidden_size), dtype=torch.bfloat16, device=dev)
        self._out = torch.empty((max_num_tokens, c.hidden_size), dtype=torch.bfloat16, device=dev)
        self._layer_id = next(_LAYER_IDS)
        _LAYERS[self._layer_id] = self
        self.last_routing = None  # (topk_weights, topk_ids) of the last forward: views of layer buffers

    # ------------------------------------------------------------------ weights
    def load_weights(self, gate_weight, correction_bias, w13: NVFP4Tensor, w2: NVFP4Tensor,
                     shared_w13: NVFP4Tensor | None = None, shared_w2: NVFP4Tensor | None = None) -> None:
        """Install weights (checkpoint order) and build the kernel layouts once (not for hot paths)."""
        c, dev = self.config, self.device
        if not isinstance(gate_weight, torch.Tensor) or gate_weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError("gate_weight: expected a bf16/fp32 tensor (E, H)")
        if tuple(gate_weight.shape) != (c.num_experts, c.hidden_size) or gate_weight.device != dev:
            raise ValueError(f"gate_weight: expected shape {(c.num_experts, c.hidden_size)} on {dev}, got "
                             f"{tuple(gate_weight.shape)} on {gate_weight.device}")
        if c.use_correction_bias:
            if correction_bias is None:
                raise ValueError("correction_bias: the config uses e_score_correction_bias; got None")
            if tuple(correction_bias.shape) != (c.num_experts,) or correction_bias.device != dev:
                raise ValueError(f"correction_bias: expected ({c.num_experts},) on {dev}, got "
                                 f"{tuple(correction_bias.shape)} on {correction_bias.device}")
            correction_bias = correction_bias.float().contiguous()
        else:
            correction_bias = None
        _check_nvfp4(w13, "w13", (c.num_experts, 2 * c.intermediate_size, c.hidden_size), dev)
        _check_nvfp4(w2, "w2", (c.num_experts, c.hidden_size, c.intermediate_size), dev)
        # fp32 once at load: the router computes its logits in fp32 (bf16 -> fp32 is exact, routing unchanged)
        self.gate_weight, self.correction_bias = gate_weight.float().contiguous(), correction_bias
        self.w13, self.w2 = w13, w2
        if self.shared is not None:
            if shared_w13 is None or shared_w2 is None:
                raise ValueError("shared_w13/shared_w2: the config has a shared expert; got None")
            self.shared.load_weights(shared_w13, shared_w2)
        if self.fused_shared:
            self._w13_kernel = gemm_ops.interleave_gate_up(_append_expert(w13, shared_w13))
            self._w2_kernel = _append_expert(w2, shared_w2)  # group E stays empty when the shared runs apart
        else:
            self._w13_kernel = gemm_ops.interleave_gate_up(w13)
            self._w2_kernel = w2

    @classmethod
    def from_bf16(cls, config: MoEConfig, gate_weight, correction_bias, w13_bf16, w2_bf16,
                  shared_w13_bf16=None, shared_w2_bf16=None, **kwargs) -> "Nvfp4MoE":
        """Quantize bf16 weights (per-expert global scales) and build the layer.

        w13_bf16: (E, 2I, H) rows [gate; up]; w2_bf16: (E, H, I); shared: (2Is, H), (H, Is).
        """
        layer = cls(config, **kwargs)
        q = quantize_weight
        layer.load_weights(
            gate_weight, correction_bias, q(w13_bf16), q(w2_bf16),
            q(shared_w13_bf16) if shared_w13_bf16 is not None else None,
            q(shared_w2_bf16) if shared_w2_bf16 is not None else None,
        )
        return layer

    @classmethod
    def random(cls, config: MoEConfig, *, seed: int = 0, return_bf16: bool = False, **kwargs):
        """A layer with random weights (std 1/sqrt(fan_in)) quantized to NVFP4; optionally also the bf16 ones."""
        device = _resolve_device(kwargs.get("device", "cpu"))
        gen = torch.Generator(device=device).manual_seed(seed)
        c = config

        def randn(*shape, scale):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

        h, i, e, si = c.hidden_size, c.intermediate_size, c.num_experts, c.shared_intermediate_size
        gate = randn(e, h, scale=h ** -0.5)
        bias = (torch.rand(e, generator=gen, device=device) * 0.1) if c.use_correction_bias else None
        w13, w2 = randn(e, 2 * i, h, scale=h ** -0.5), randn(e, h, i, scale=i ** -0.5)
        s13 = randn(2 * si, h, scale=h ** -0.5) if si else None
        s2 = randn(h, si, scale=si ** -0.5) if si else None
        layer = cls.from_bf16(c, gate, bias, w13, w2, s13, s2, **kwargs)
        if return_bf16:
            return layer, {"gate_weight": gate, "correction_bias": bias, "w13": w13, "w2": w2,
                           "shared_w13": s13, "shared_w2": s2}
        return layer

    # ------------------------------------------------------------------ forward
    def route(self, hidden_states: torch.Tensor, out=None):
        """(topk_weights (T, k) fp32, topk_ids (T, k) int32) with the layer's router backend."""
        c = self.config
        return moe_ops.route(
            hidden_states, self.gate_weight, self.correction_bias, top_k=c.top_k, scoring_func=c.scoring_func,
            n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, backend=self.router_backend, out=out,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(T, H) bf16 -> (T, H) bf16 (a view of the layer's output buffer). Sync-free, graph-capturable."""
        if self._w13_kernel is None:
            raise RuntimeError("Nvfp4MoE: call load_weights() first")
        c = self.config
        _check_hidden(hidden_states, c.hidden_size, self.max_num_tokens, self.device)
        t = hidden_states.shape[0]
        fuse = self.fused_shared and t <= self.fuse_shared_max_tokens
        pairs = t * (self._slots if fuse else c.top_k)
        out = self._out[:t]
        if t == 0:
            return out
        if fuse:  # the router writes the first k columns; column k is the shared expert (id E, weight 1)
            topk_weights, topk_ids = self.route(hidden_states, out=(self._weights_ext, self._ids_ext))
            self.last_routing = (topk_weights, topk_ids)
            topk_ids, topk_weights = self._ids_ext[:t], self._weights_ext[:t]
        else:
            topk_weights, topk_ids = self.route(hidden_states, out=(self._route_weights, self._route_ids))
            self.last_routing = (topk_weights, topk_ids)
        backend = self.dispatch_backend
        if backend == "auto":  # host decision on a shape: the one-launch kernel for decode-sized batches
            backend = "triton" if pairs <= DISPATCH_KERNEL_MAX_PAIRS else "torch"
        d = moe_ops.dispatch(topk_ids, self._groups, buffers=self._dispatch_buffers, backend=backend)
        offsets = d["expert_offsets"]
        x, gemm_mode = hidden_states, self.mode
        static = self.mode == "w4a4" and self.input_scales is not None
        if static:
            x, gemm_mode = _quant_roundtrip(hidden_states, self.input_scales["l1"], self._x_q[:t]), "w4a16"
        inter = gemm_ops.nvfp4_grouped_mm(
            x, self._w13_kernel, offsets, mode=gemm_mode, out=self._inter[:pairs], row_index=d["row_index"],
            activation="swiglu", swiglu_limit=c.swiglu_limit,
        )
        if static:
            l2 = self.input_scales.get("l2_groups", self.input_scales["l2"])
            row_scale = l2.index_select(0, d["sorted_expert"]).unsqueeze(1)  # (pairs, 1)
            inter = _quant_roundtrip(inter, row_scale, self._inter_q[:pairs])
        expert_out = gemm_ops.nvfp4_grouped_mm(inter, self._w2_kernel, offsets, mode=gemm_mode,
                                               out=self._expert_out[:pairs])
        shared = self.shared.forward(hidden_states) if self.shared is not None and not fuse else None
        return moe_ops.combine(expert_out, d["inv_perm"], topk_weights, shared, out=out)

    __call__ = forward

    def compiled_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``forward`` through the ``megamoe::moe_layer_forward`` custom op (opaque to torch.compile; returns a copy)."""
        return torch.ops.megamoe.moe_layer_forward(hidden_states, self._layer_id)

    def reference_forward(self, hidden_states: torch.Tensor, routing=None) -> torch.Tensor:
        """Float32 reference layer on decoded weights with the same routing: (T, H) float32.

        routing: (topk_weights, topk_ids) to reuse (default: route again, identically).
        """
        topk_weights, topk_ids = routing if routing is not None else self.route(hidden_states)
        scales = self.input_scales or {}
        if self.shared is not None and self.shared.input_scales:
            scales = {**scales, "shared_l1": self.shared.input_scales["l1"],
                      "shared_l2": self.shared.input_scales["l2"]}
        return moe_reference.moe_forward(
            hidden_states, topk_weights, topk_ids, self.w13, self.w2, swiglu_limit=self.config.swiglu_limit,
            shared_w13=self.shared.w13 if self.shared else None, shared_w2=self.shared.w2 if self.shared else None,
            mode=self.mode, input_scales=scales or None,
        )

    # ------------------------------------------------------------- calibration
    @torch.no_grad()
    def calibrate(self, hidden_states_sample: torch.Tensor) -> dict:
        """Static w4a4 activation global scales from a sample batch (not for hot paths; syncs).

        l1: ``amax(sample) / 2688`` (per tensor); l2: per expert, the amax of that
        expert's SwiGLU output on the sample (w4a16 L1) / 2688; experts that got no
        rows take the largest observed scale. The shared expert gets its own
        l1/l2. Sets ``mode = "w4a4"`` with these static scales; returns them.
        """
        c = self.config
        x = hidden_states_sample
        _check_hidden(x, c.hidden_size, self.max_num_tokens, self.device)
        if x.shape[0] == 0:
            raise ValueError("hidden_states_sample: expected at least one token")
        l1 = quantize_ops.compute_global_scale(x)
        _, topk_ids = self.route(x)
        d = moe_ops.dispatch(topk_ids, self._groups)  # routed rows only; the fused shared group stays empty
        inter = gemm_ops.nvfp4_grouped_mm(x, self._w13_kernel, d["expert_offsets"], row_index=d["row_index"],
                                          activation="swiglu", swiglu_limit=c.swiglu_limit)
        row_amax = inter.float().abs().nan_to_num(0.0).amax(dim=1)
        expert_amax = torch.zeros(c.num_experts, device=self.device).scatter_reduce_(
            0, d["sorted_expert"].long(), row_amax, reduce="amax")
        seen = torch.zeros(c.num_experts, dtype=torch.bool, device=self.device)
        seen[d["sorted_expert"].long()] = True
        expert_amax = torch.where(seen, expert_amax, expert_amax.max())
        from ..format.constants import AMAX_FLOOR, GLOBAL_SCALE_DIVISOR

        l2 = (expert_amax.clamp(min=AMAX_FLOOR) / GLOBAL_SCALE_DIVISOR).float()
        self.input_scales = {"l1": l1, "l2": l2}
        self.mode = "w4a4"
        if self.shared is not None:
            s = self.shared
            s_w13 = gemm_ops.interleave_gate_up(_stack1(s.w13))
            s_inter = gemm_ops.nvfp4_grouped_mm(x, s_w13, torch.full((1,), x.shape[0], dtype=torch.int32,
                                                device=self.device), activation="swiglu",
                                                swiglu_limit=s.swiglu_limit)
            s.input_scales = {"l1": l1, "l2": quantize_ops.compute_global_scale(s_inter)}
            s.mode = "w4a4"
        self._fuse_scales()
        return self.input_scales

    def _fuse_scales(self) -> None:
        """Fused shared expert: one L1 scale for all (the max), L2 scale of group E = the shared one."""
        if not self.fused_shared or self.input_scales is None or not self.shared.input_scales:
            return
        l1 = torch.maximum(self.input_scales["l1"], self.shared.input_scales["l1"])
        self.input_scales["l1"] = self.shared.input_scales["l1"] = l1
        l2 = self.input_scales["l2"][: self.config.num_experts]
        self.input_scales["l2_groups"] = torch.cat((l2, self.shared.input_scales["l2"].reshape(1)))

    def set_input_scales(self, l1: torch.Tensor, l2: torch.Tensor, shared_l1=None, shared_l2=None) -> None:
        """Static w4a4 scales (e.g. ModelOpt ``input_scale``): l1 0-d, l2 (E,) fp32 on the layer's device."""
        c = self.config
        if l1.dim() != 0 or tuple(l2.shape) != (c.num_experts,):
            raise ValueError(f"l1/l2: expected a 0-d tensor and ({c.num_experts},), got "
                             f"{tuple(l1.shape)} and {tuple(l2.shape)}")
        self.input_scales = {"l1": l1.float().to(self.device), "l2": l2.float().to(self.device)}
        if self.shared is not None and shared_l1 is not None and shared_l2 is not None:
            self.shared.input_scales = {"l1": shared_l1.float().to(self.device),
                                        "l2": shared_l2.float().to(self.device)}
        elif self.fused_shared:
            raise ValueError("shared_l1/shared_l2: the fused shared expert needs its static scales too")
        self._fuse_scales()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.mode = mode
        if self.shared is not None:
            self.shared.mode = mode

    # ------------------------------------------------------------ CUDA graphs
    def capture(self, num_tokens: int, *, warmup: int = 2):
        """Capture ``forward`` for ``num_tokens`` tokens into a CUDA graph.

        Returns ``run(hidden_states) -> out``: copies the (num_tokens, H) bf16
        input into the graph's static input, replays, returns the static output
        (the layer's output buffer; valid until the next call).
        """
        if self.device.type != "cuda":
            raise RuntimeError("capture: CUDA graphs need a CUDA layer")
        if not 1 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"num_tokens: expected 1..{self.max_num_tokens}, got {num_tokens}")
        static_in = torch.zeros((num_tokens, self.config.hidden_size), dtype=torch.bfloat16, device=self.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.forward(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.forward(static_in)

        def run(hidden_states: torch.Tensor) -> torch.Tensor:
            if tuple(hidden_states.shape) != tuple(static_in.shape):
                raise ValueError(f"hidden_states: the graph was captured for shape {tuple(static_in.shape)}, "
                                 f"got {tuple(hidden_states.shape)}")
            static_in.copy_(hidden_states)
            graph.replay()
            return static_out

        run.graph, run.static_input, run.static_output = graph, static_in, static_out
        return run

    def weight_bytes(self, experts_touched: int | None = None) -> int:
        """Bytes of NVFP4 weights read for ``experts_touched`` routed experts (+ shared expert + gate)."""
        c = self.config
        e = c.num_experts if experts_touched is None else experts_touched
        per_expert = (self.w13.nbytes() + self.w2.nbytes()) // c.num_experts
        total = e * per_expert + self.gate_weight.numel() * 2  # the checkpoint's bf16 gate (held as fp32 here)
        if self.shared is not None:
            total += self.shared.w13.nbytes() + self.shared.w2.nbytes()
        return total


def _per_expert_global_scale(gs: torch.Tensor, experts: int) -> torch.Tensor:
    """0-d / (E,1,1) / (E,R,1) / (R,1) -> (experts, 1 or R, 1)."""
    if gs.dim() == 0:
        return gs.reshape(1, 1, 1).expand(experts, 1, 1)
    if gs.dim() == 2:
        gs = gs.unsqueeze(0)
    return gs.expand(experts, gs.shape[1], 1)


def _append_expert(stacked: NVFP4Tensor, extra: NVFP4Tensor) -> NVFP4Tensor:
    """(E, N, K) stacked experts + one (N, K) expert -> (E+1, N, K), global scales merged exactly (load time)."""
    e = stacked.shape[0]
    gs_a = _per_expert_global_scale(stacked.global_scale, e)
    gs_b = _per_expert_global_scale(extra.global_scale, 1)
    rows = max(gs_a.shape[1], gs_b.shape[1])
    gs = torch.cat((gs_a.expand(e, rows, 1), gs_b.expand(1, rows, 1))).contiguous()
    return NVFP4Tensor(
        torch.cat((stacked.data, extra.data.unsqueeze(0))),
        torch.cat((stacked.block_scale, extra.block_scale.unsqueeze(0))),
        gs,
        (e + 1,) + tuple(stacked.shape[1:]),
    )


def quantize_weight(w: torch.Tensor) -> NVFP4Tensor:
    """bf16 weight (N, K) -> NVFP4 with one global scale; (E, N, K) -> one global scale per expert (E,1,1)."""
    if w.dim() == 3:
        gs = quantize_ops.compute_global_scale(w.reshape(w.shape[0], -1), per_row=True).reshape(-1, 1, 1)
        return quantize_ops.quantize(w, gs)
    return quantize_ops.quantize(w)


@torch.library.custom_op("megamoe::moe_layer_forward", mutates_args=())
def _moe_layer_forward(hidden_states: torch.Tensor, layer_id: int) -> torch.Tensor:
    return _LAYERS[layer_id].forward(hidden_states).clone()


@_moe_layer_forward.register_fake
def _moe_layer_forward_fake(hidden_states: torch.Tensor, layer_id: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)
